"""Fine-tuning strategies (model.finetune): each trains exactly what it says; a LoRA model kept merged computes what
the adapted one computes."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneConfig, LoraSettings, merged_copy, parameter_counts, strategy_for
from pipeline.models.lightning_module import OptimConfig, PainLightningModule, parameter_groups
from pipeline.models.model_file import load_model_file, model_meta, save_model_file
from pipeline.utils.config import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIM = OptimConfig(head_lr=1e-2, backbone_lr=1e-3, layer_decay=0.8, weight_decay=0.05, warmup_epochs=0,
                    freeze_backbone_epochs=0)
TIMM_ATTENTION = r".*\.attn\.(qkv|proj)"


def config(strategy: str, blocks: int | None = 2, target: str = TIMM_ATTENTION) -> FinetuneConfig:
    return FinetuneConfig(strategy, blocks, LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=target),
                          cache_embeddings=False)


def prepared(name: str, finetune: FinetuneConfig, seed: int = 0) -> tuple[PainNet, PainLightningModule]:
    torch.manual_seed(seed)
    net, _ = create_model(name, n_classes=2, img_size=32)
    strategy = strategy_for(finetune)
    strategy.prepare(net)
    return net, PainLightningModule(net, ("BL1", "PA4"), OPTIM, aggregation="mean", topk=3, finetune=strategy)


def one_step(module: PainLightningModule) -> dict[str, torch.Tensor]:
    """One AdamW step on a random batch, as configure_optimizers builds it; returns the weights before it."""
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    module.train()
    optimizer = torch.optim.AdamW(parameter_groups(module.model, OPTIM))
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1])
    nn.functional.cross_entropy(module(images), labels).backward()
    optimizer.step()
    return before


def expected_trainable(net: PainNet, strategy: str) -> set[str]:
    names = [name for name, _ in net.named_parameters()]
    head = {name for name in names if name.startswith("head.")}
    if strategy == "full":
        return set(names)
    if strategy == "frozen":
        return head
    if strategy == "lora":
        return head | {name for name in names if "lora_" in name}
    top = net.backbone.parameter_groups()[-2:]  # top_blocks with finetune_blocks=2
    ids = {id(p) for _, parameters in top for p in parameters}
    return head | {name for name, p in net.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("strategy", ["full", "frozen", "top_blocks", "lora"])
def test_each_strategy_trains_exactly_its_parameters(strategy: str) -> None:
    """MobileViT-XXS (convolutions with batch norm, transformer blocks with timm attention): after one optimizer step
    the parameters with a gradient, the optimizer's and the changed ones are the strategy's, no other; the frozen
    batch norms keep their running statistics."""
    net, module = prepared("mobilevit_xxs", config(strategy))
    trainable = expected_trainable(net, strategy)
    optimised = {id(p) for group in parameter_groups(net, OPTIM) for p in group["params"]}
    assert {name for name, p in net.named_parameters() if id(p) in optimised} == trainable
    stats_before = {name: b.clone() for name, b in net.backbone.named_buffers() if name.endswith("running_mean")}
    before = one_step(module)
    with_gradient = {name for name, p in net.named_parameters() if p.grad is not None}
    changed = {name for name, p in net.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert with_gradient == trainable
    assert changed <= trainable and changed  # a zero-initialised LoRA B moves, its A not yet (its gradient is 0)
    frozen_norms = [m for m in net.backbone.modules() if isinstance(m, nn.BatchNorm2d)
                    and not any(p.requires_grad for p in m.parameters())]
    assert all(not m.training for m in frozen_norms)
    stats_after = dict(net.backbone.named_buffers())
    for name, value in stats_before.items():
        norm_frozen = not any(p.requires_grad for p in net.backbone.get_submodule(name.rsplit(".", 1)[0]).parameters())
        assert torch.equal(value, stats_after[name]) == norm_frozen, name
    counts = parameter_counts(net)
    assert counts["parameters_trainable"] == sum(p.numel() for name, p in net.named_parameters() if name in trainable)
    if strategy == "frozen":
        assert not any(m.training for m in net.backbone.modules())  # dropout and drop-path off too


def test_lora_targets_of_the_configs_fit_vit_and_cvt() -> None:
    """The target regexes of configs/model/ find the attention projections of a timm ViT and of HF CvT."""
    for model, block_names in (("vit_b16", ("attn.qkv", "attn.proj")),
                               ("cvt_13", ("projection_query", "projection_key", "projection_value",
                                           "attention.output.dense"))):
        cfg = load_config([f"model={model}", "model.finetune=lora"])
        finetune = FinetuneConfig.from_config(cfg.model, cfg.cache)
        with torch.device("meta"):
            net, _ = create_model(model, img_size=32)
        strategy_for(finetune).prepare(net)
        adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in net.backbone.named_parameters() if ".lora_A." in name}
        assert adapted and all(any(name.endswith(block) for block in block_names) for name in adapted), model
        assert not any("intermediate" in name or "mlp" in name for name in adapted)


def test_a_lora_model_kept_merged_computes_what_the_adapted_one_does(tmp_path) -> None:
    net, module = prepared("mobilevit_xxs", config("lora"))
    for name, parameter in net.named_parameters():
        if "lora_B" in name:  # as after training: peft starts B at zero, which would make the test trivial
            nn.init.normal_(parameter, std=0.05)
    images = torch.randn(3, 3, 32, 32)
    net.eval()
    with torch.no_grad():
        adapted = net(images)
        kept = module.finetune.for_keeping(net).eval()
        merged = kept(images)
    assert not any("lora" in key for key in kept.state_dict())
    assert (adapted - merged).abs().max().item() < 1e-5
    with torch.no_grad():
        for layer in net.modules():
            if isinstance(layer, LoraLayer):
                layer.enable_adapters(False)  # the base layers alone: the adapters' share is not zero
        assert (net(images) - adapted).abs().max().item() > 1e-4
    meta = model_meta(kept, model_name="mobilevit_xxs", img_size=32, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={}, weights={"kind": "random"})
    loaded, _ = load_model_file(save_model_file(kept, meta, tmp_path / "model.pt"))
    with torch.no_grad():
        assert (loaded(images) - adapted).abs().max().item() < 1e-5
    assert merged_copy(net) is not net and any("lora_" in name for name, _ in net.named_parameters())


def test_vit_b16_lora_rank_8_trains_under_2_percent_of_the_backbone() -> None:
    cfg = load_config(["model=vit_b16", "model.finetune=lora"])
    with torch.device("meta"):
        net, _ = create_model("vit_b16", img_size=224)
    strategy_for(FinetuneConfig.from_config(cfg.model, cfg.cache)).prepare(net)
    counts = parameter_counts(net)
    assert counts["backbone_parameters_trainable"] / counts["backbone_parameters"] < 0.02
    assert counts["backbone_parameters_trainable"] == counts["backbone_adapter_parameters"] > 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model.finetune"):
        config("partial")
    with pytest.raises(ValueError, match="finetune_blocks"):
        config("top_blocks", blocks=0)
    with pytest.raises(ValueError, match="matches no module"):
        prepared("mobilevit_xxs", config("lora", target=r".*\.nothing"))
    with pytest.raises(ValueError, match="parameter groups"):
        prepared("mobilevit_xxs", config("top_blocks", blocks=99))


def test_compare_names_strategies_and_weights_files_apart() -> None:
    from pipeline.runs.store.cv_runs import cv_label

    assert cv_label({"model": "vit_b16", "finetune": "full", "weights_source": "random"}) == "vit_b16"
    assert cv_label({"model": "vit_b16"}) == "vit_b16"  # a CV from before strategies existed
    assert cv_label({"model": "vit_b16", "finetune": "lora_r8", "weights_source": "file",
                     "weights_sha256": "1a2b3c4d5e"}) == "vit_b16 lora_r8 weights 1a2b3c4d"


def test_make_compare_sets_two_strategies_of_one_backbone_against_each_other(tiny_base, tmp_path) -> None:
    """Full and frozen CVs of the same backbone on the same folds: `make compare` keeps them apart by their label
    (`cv_label`) in every table, the fold scores included, and pairs them subject by subject."""
    import pandas as pd

    from pipeline.analysis.compare import run_compare
    from pipeline.runs.orchestration.cross_validation import run_cv
    from tests.conftest import tiny_overrides
    from tests.test_cv import FAST

    settings = [o for o in FAST if not o.startswith(("trainer.folds", "trainer.max_epochs"))]
    common = (*settings, "trainer.folds=[0]", "trainer.max_epochs=1", f"mlflow.tracking_uri=sqlite:///{tmp_path}/c.db",
              f"cv.work_dir={tmp_path}/runs", f"reports_dir={tmp_path}/reports", "compare.allow_incomplete=true")
    for extra in ((), ("model.finetune=frozen",), ("model.finetune=top_blocks",)):
        run_cv(load_config(tiny_overrides(tiny_base, *common, *extra)))
    everything = run_compare(load_config(tiny_overrides(tiny_base, *common)))
    assert set(everything["parent_run_ids"]) == {"mobilevit_xxs", "mobilevit_xxs frozen", "mobilevit_xxs top_blocks2"}
    # compare.only: the pairs asked about and no others (the correction's family shrinks with them)
    only = 'compare.only=["mobilevit_xxs","mobilevit_xxs frozen"]'
    result = run_compare(load_config(tiny_overrides(tiny_base, *common, only)))
    labels = {"mobilevit_xxs", "mobilevit_xxs frozen"}
    assert set(result["parent_run_ids"]) == labels
    assert len(result["subjects_paired"]) < len(everything["subjects_paired"])
    with pytest.raises(SystemExit, match=r"compare.only names 'mobilevit_xxs lora_r8'.*'mobilevit_xxs top_blocks2'"):
        run_compare(load_config(tiny_overrides(tiny_base, *common, 'compare.only=["mobilevit_xxs lora_r8"]')))
    assert set(pd.read_csv(result["paths"]["summary"]).model) == labels
    folds = pd.read_csv(result["paths"]["folds"])
    assert set(folds.model) == labels and len(folds) == 2  # one fold each, neither merged into the other
    assert set(result["paired"].model_a) | set(result["paired"].model_b) == labels
