"""Fine-tuning pipeline for automatic pain detection from facial video (BioVid Heat Pain Database, Part A).

Subpackages by role, each importing only those below it (the layers contract in pyproject.toml, checked by
`make lint` and `make test`):

    cli                      the command line: dispatches, nothing else
    deployment               the final model, predictions on new videos, export
    analysis | course        comparison, inspection, calculator, benchmarks | the ViT course's helpers
    runs                     MLflow store rules, fold jobs, launchers, the cross-validation driver
    models                   backbone adapters, weights, the LightningModule and its callbacks, kept models, cost
    data | evaluation        BioVid and the twin, faces, crops, folds, loaders | metrics and thresholds
    utils                    config and logging set-up, paths, atomic files, CPUs, devices, seeds
"""

__version__ = "0.1.0"
