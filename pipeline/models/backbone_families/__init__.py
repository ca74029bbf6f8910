"""Backbone families, one module each: every module here registers its adapter (`backbone_adapter.register_adapter`)
when `pipeline.models.backbones` imports the folder. A new family is a new module here."""
