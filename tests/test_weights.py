"""Pretrained weights: local files of each family load exactly, the hub cache is read offline, nothing is silent.

Source checkpoints are made here from randomly initialised models whose every tensor is perturbed (so LayerNorm
ones and zero biases cannot match by accident), saved the way their publishers save them (timm models with their
classifier head, CvT as `save_pretrained` folders), then loaded with pretrained=True.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed
from transformers import CvtConfig, CvtForImageClassification

from pipeline.models.backbone_families.cvt import CVT_VARIANTS
from pipeline.models.backbone_families.timm_models import TIMM_ARCHITECTURES
from pipeline.models.backbones import create_backbone
from pipeline.models.factory import create_model
from pipeline.models.weights import (
    RANDOM_INIT,
    IncompatibleWeights,
    WeightsSource,
    WeightsUnavailable,
    hub_cache_dir,
    resolve_weights,
)
from pipeline.runs.store import tracking
from tests.conftest import planned

# small tensors: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VIT = "vit_tiny_patch16_224.augreg_in21k"  # the ViT-B/16 code path (same tag family, 21k-class head) at 1/16 cost
MOBILEVIT = "mobilevit_xxs"


@pytest.fixture(autouse=True)
def empty_offline_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test sees an empty hub cache of its own and no network."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf_home" / "hub"


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator))
    return module


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_same_tensors(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=f"{key} differs")


@pytest.fixture(scope="module")
def vit_source() -> dict[str, torch.Tensor]:
    """A ViT checkpoint as timm publishes it: 224 px position grid and the 21k-class head."""
    model = _perturbed(timm.create_model(VIT), seed=1)
    assert model.head.out_features == 21843
    return {key: value.clone() for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def mobilevit_source() -> dict[str, torch.Tensor]:
    model = _perturbed(timm.create_model(TIMM_ARCHITECTURES[MOBILEVIT]), seed=2)
    return {key: value.clone() for key, value in model.state_dict().items()}


def _without_head(state_dict: dict[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    kept = {key: value for key, value in state_dict.items() if not key.startswith(head + ".")}
    assert len(kept) < len(state_dict), "the source checkpoint must carry a head for this test to mean anything"
    return kept


def _save(state_dict: dict[str, torch.Tensor], path: Path, wrapper: str | None = None) -> Path:
    if path.suffix == ".safetensors":
        save_file({key: value.contiguous() for key, value in state_dict.items()}, str(path))
    else:
        torch.save({wrapper: state_dict, "epoch": 3} if wrapper else state_dict, path)
    return path


# --- local files, each family ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file_name", "wrapper"), [("vit.safetensors", None), ("vit.pth", "state_dict"), ("vit.bin", None)]
)
def test_vit_state_dict_file_loads_exactly_without_its_head(
    vit_source: dict, tmp_path: Path, file_name: str, wrapper: str | None
) -> None:
    path = _save(vit_source, tmp_path / file_name, wrapper)
    backbone, source = create_backbone(VIT, pretrained=True, weights=path)
    _assert_same_tensors(backbone.model.state_dict(), _without_head(vit_source, "head"))
    assert source == WeightsSource(kind="file", ref=str(path), sha256=_sha256(path))


@pytest.mark.parametrize(("file_name", "wrapper"), [("mobilevit.safetensors", None), ("mobilevit.pt", "model")])
def test_mobilevit_state_dict_file_loads_exactly_without_its_head(
    mobilevit_source: dict, tmp_path: Path, file_name: str, wrapper: str | None
) -> None:
    path = _save(mobilevit_source, tmp_path / file_name, wrapper)
    backbone, source = create_backbone(MOBILEVIT, pretrained=True, weights=path)
    _assert_same_tensors(backbone.model.state_dict(), _without_head(mobilevit_source, "head.fc"))
    assert (source.kind, source.sha256) == ("file", _sha256(path))


def test_vit_img_size_override_interpolates_the_pretrained_position_embeddings(
    vit_source: dict, tmp_path: Path
) -> None:
    path = _save(vit_source, tmp_path / "vit.safetensors")
    backbone, _ = create_backbone(VIT, pretrained=True, weights=path, img_size=64)
    loaded = backbone.model.state_dict()
    source_grid = vit_source["pos_embed"]
    assert source_grid.shape[1] == 1 + 14 * 14
    assert loaded["pos_embed"].shape == (1, 1 + 4 * 4, source_grid.shape[2])
    expected = resample_abs_pos_embed(source_grid, new_size=[4, 4], num_prefix_tokens=1)
    torch.testing.assert_close(loaded["pos_embed"], expected)
    torch.testing.assert_close(loaded["pos_embed"][:, :1], source_grid[:, :1], rtol=0, atol=0)
    others = {key: value for key, value in _without_head(vit_source, "head").items() if key != "pos_embed"}
    _assert_same_tensors({key: loaded[key] for key in others}, others)
    assert backbone.data_config.input_size == (3, 64, 64)
    with torch.no_grad():
        assert backbone(torch.randn(1, 3, 64, 64)).shape == (1, backbone.num_features)


def _write_augreg_npz(state_dict: dict[str, torch.Tensor], num_heads: int, path: Path) -> Path:
    """Write a ViT state dict in the original augreg / big_vision `.npz` layout (the inverse of timm's reader)."""

    def array(key: str) -> np.ndarray:
        return state_dict[key].detach().numpy()

    width = state_dict["cls_token"].shape[-1]
    head_dim = width // num_heads
    depth = len({key.split(".")[1] for key in state_dict if key.startswith("blocks.")})
    arrays = {
        "embedding/kernel": array("patch_embed.proj.weight").transpose(2, 3, 1, 0),  # OIHW -> HWIO
        "embedding/bias": array("patch_embed.proj.bias"),
        "cls": array("cls_token"),
        "Transformer/posembed_input/pos_embedding": array("pos_embed"),
        "Transformer/encoder_norm/scale": array("norm.weight"),
        "Transformer/encoder_norm/bias": array("norm.bias"),
        "head/kernel": array("head.weight").T,
        "head/bias": array("head.bias"),
    }
    for index in range(depth):
        block, prefix = f"blocks.{index}.", f"Transformer/encoderblock_{index}/"
        attention = prefix + "MultiHeadDotProductAttention_1/"
        for norm, name in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            arrays[f"{prefix}{name}/scale"] = array(f"{block}{norm}.weight")
            arrays[f"{prefix}{name}/bias"] = array(f"{block}{norm}.bias")
        weights = np.split(array(f"{block}attn.qkv.weight"), 3)  # each (out, in)
        biases = np.split(array(f"{block}attn.qkv.bias"), 3)
        for name, weight, bias in zip(("query", "key", "value"), weights, biases, strict=True):
            arrays[f"{attention}{name}/kernel"] = weight.T.reshape(width, num_heads, head_dim)
            arrays[f"{attention}{name}/bias"] = bias.reshape(num_heads, head_dim)
        arrays[f"{attention}out/kernel"] = array(f"{block}attn.proj.weight").reshape(width, num_heads, head_dim)
        arrays[f"{attention}out/kernel"] = arrays[f"{attention}out/kernel"].transpose(1, 2, 0)
        arrays[f"{attention}out/bias"] = array(f"{block}attn.proj.bias")
        for layer in (0, 1):
            arrays[f"{prefix}MlpBlock_3/Dense_{layer}/kernel"] = array(f"{block}mlp.fc{layer + 1}.weight").T
            arrays[f"{prefix}MlpBlock_3/Dense_{layer}/bias"] = array(f"{block}mlp.fc{layer + 1}.bias")
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("img_size", [None, 64])
def test_vit_big_vision_npz_loads_through_timms_reader(vit_source: dict, tmp_path: Path, img_size: int | None) -> None:
    path = _write_augreg_npz(vit_source, num_heads=3, path=tmp_path / "ViT-Ti_16.npz")
    backbone, source = create_backbone(VIT, pretrained=True, weights=path, img_size=img_size)
    loaded = backbone.model.state_dict()
    expected = _without_head(vit_source, "head")
    if img_size is not None:
        expected["pos_embed"] = resample_abs_pos_embed(
            expected["pos_embed"], new_size=[4, 4], num_prefix_tokens=1, interpolation="bilinear", antialias=False
        )
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, msg=f"{key} differs")  # float32 round trip through numpy
    assert loaded.keys() == expected.keys()
    assert source == WeightsSource(kind="file", ref=str(path), sha256=_sha256(path))


def _cvt_classifier(name: str, seed: int) -> CvtForImageClassification:
    """A CvT as Microsoft published it on the hub: with final LayerNorm and a 1000-class classifier."""
    variant = CVT_VARIANTS[name]
    config = CvtConfig(depth=list(variant.depth), num_labels=1000)
    return _perturbed(CvtForImageClassification(config), seed=seed)


def test_cvt_image_classification_folder_loads_exactly_without_its_classifier(tmp_path: Path) -> None:
    source_model = _cvt_classifier("cvt_13", seed=3)
    source_model.save_pretrained(tmp_path / "cvt-13")
    saved = {key: value for key, value in source_model.state_dict().items() if not key.startswith("classifier.")}
    backbone, source = create_backbone("cvt_13", pretrained=True, weights=tmp_path / "cvt-13")
    _assert_same_tensors(backbone.state_dict(), saved)
    weight_file = tmp_path / "cvt-13" / "model.safetensors"
    assert source == WeightsSource(kind="file", ref=str(weight_file), sha256=_sha256(weight_file))


def test_cvt_model_save_pretrained_folder_loads_and_keeps_the_final_norm_at_identity(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source_backbone, _ = create_backbone("cvt_21")
    _perturbed(source_backbone, seed=4)
    source_backbone.cvt.save_pretrained(tmp_path / "cvt-21")
    with caplog.at_level(logging.WARNING, logger="pipeline.models.backbones"):
        backbone, source = create_backbone("cvt_21", pretrained=True, weights=tmp_path / "cvt-21")
    assert "without the final LayerNorm" in caplog.text
    _assert_same_tensors(backbone.cvt.state_dict(), source_backbone.cvt.state_dict())
    assert torch.equal(backbone.layernorm.weight, torch.ones(384))
    assert torch.equal(backbone.layernorm.bias, torch.zeros(384))
    assert source.kind == "file" and source.ref.endswith("model.safetensors")


def test_cvt_state_dict_file_loads(tmp_path: Path) -> None:
    source_model = _cvt_classifier("cvt_13", seed=5)
    path = _save(source_model.state_dict(), tmp_path / "cvt13.pth", wrapper="state_dict")
    model, source = create_model("cvt_13", pretrained=True, weights=path)
    saved = {key: value for key, value in source_model.state_dict().items() if not key.startswith("classifier.")}
    _assert_same_tensors(model.backbone.state_dict(), saved)
    assert source.sha256 == _sha256(path)


# --- the Hugging Face hub cache (offline) ----------------------------------------------------------------------------


def _put_in_hub_cache(cache: Path, repo_id: str, file: Path, filename: str) -> Path:
    """Lay `file` out as huggingface_hub's cache does: blobs by hash, a snapshot per commit linking to them."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / _sha256(file)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(file.read_bytes())
    snapshot = repo / "snapshots" / commit / filename
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("pretrained", [True, "auto"])
def test_timm_weights_in_the_hub_cache_load_as_hub(
    mobilevit_source: dict, empty_offline_hub_cache: Path, tmp_path: Path, pretrained: bool | str
) -> None:
    repo_id = timm.models.get_pretrained_cfg(TIMM_ARCHITECTURES[MOBILEVIT]).hf_hub_id
    assert repo_id == "timm/mobilevit_xxs.cvnets_in1k"
    file = _save(mobilevit_source, tmp_path / "model.safetensors")
    _put_in_hub_cache(empty_offline_hub_cache, repo_id, file, "model.safetensors")
    assert hub_cache_dir() == empty_offline_hub_cache
    backbone, source = create_backbone(MOBILEVIT, pretrained=pretrained)
    _assert_same_tensors(backbone.model.state_dict(), _without_head(mobilevit_source, "head.fc"))
    assert source == WeightsSource(kind="hub", ref=repo_id, sha256=_sha256(file))
    assert tracking.weights_tags(source) == {"weights_source": "hub", "weights_ref": repo_id,
                                             "weights_sha256": _sha256(file)}


def test_cvt_weights_in_the_hub_cache_load_as_hub(empty_offline_hub_cache: Path, tmp_path: Path) -> None:
    source_model = _cvt_classifier("cvt_13", seed=6)
    file = _save(source_model.state_dict(), tmp_path / "pytorch_model.bin")  # the file microsoft/cvt-13 ships
    _put_in_hub_cache(empty_offline_hub_cache, "microsoft/cvt-13", file, "pytorch_model.bin")
    backbone, source = create_backbone("cvt_13", pretrained=True)
    assert torch.equal(backbone.layernorm.weight, source_model.layernorm.weight)
    assert (source.kind, source.ref, source.sha256) == ("hub", "microsoft/cvt-13", _sha256(file))


# --- no weights: loud, never silent ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "repo_id"),
    [("vit_b16", "timm/vit_base_patch16_224.augreg_in21k"), ("cvt_21", "microsoft/cvt-21")],
)
def test_pretrained_without_weights_or_cache_says_how_to_provide_them(
    empty_offline_hub_cache: Path, name: str, repo_id: str
) -> None:
    with pytest.raises(WeightsUnavailable) as raised:
        create_backbone(name, pretrained=True)
    message = str(raised.value)
    for needed in ("WEIGHTS=", "model.weights=", "HF_HOME", f"hf download {repo_id}"):
        assert needed in message
    assert str(empty_offline_hub_cache) in message


def test_hub_cache_location_is_read_from_the_environment_at_call_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_auto_without_weights_warns_loudly_and_falls_back_to_random(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="RANDOM initialisation") as warned:
        model, source = create_model(MOBILEVIT, pretrained="auto")
    assert "timm/mobilevit_xxs.cvnets_in1k" in str(warned[0].message)
    assert any(record.levelno == logging.WARNING and "RANDOM" in record.getMessage() for record in caplog.records)
    assert source == RANDOM_INIT and tracking.weights_tags(source)["weights_source"] == "random"
    assert model.head.out_features == 2


def test_random_init_records_random() -> None:
    _, source = create_backbone(MOBILEVIT, pretrained=False)
    assert tracking.weights_tags(source) == {"weights_source": "random", "weights_ref": "", "weights_sha256": ""}


def test_auto_does_not_hide_a_weights_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        create_backbone(MOBILEVIT, pretrained="auto", weights=tmp_path / "missing.safetensors")


def test_weights_with_pretrained_false_is_an_error_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pretrained=False"):
        resolve_weights(False, tmp_path / "x.pth", model_name="m", hub_repo=None)
    with pytest.raises(ValueError, match="one of True, False, 'auto'"):
        resolve_weights("yes", None, model_name="m", hub_repo=None)


# --- wrong files: clear errors naming the file -----------------------------------------------------------------------


def test_weights_of_another_architecture_name_the_file_and_the_first_bad_keys(
    mobilevit_source: dict, tmp_path: Path
) -> None:
    path = _save(mobilevit_source, tmp_path / "actually_mobilevit.safetensors")
    with pytest.raises(IncompatibleWeights, match="actually_mobilevit.safetensors") as raised:
        create_backbone(VIT, pretrained=True, weights=path)
    message = str(raised.value)
    assert "missing keys (first: cls_token, pos_embed, patch_embed.proj.weight" in message
    assert re.search(r"unexpected keys \(first: (stem|stages|final_conv)\.\S+\.(weight|bias)", message)


def test_a_wider_vit_gives_shape_mismatches(tmp_path: Path) -> None:
    wider = timm.create_model("vit_small_patch16_224", num_classes=0, depth=2)  # same keys for blocks 0-1, wider
    path = _save(wider.state_dict(), tmp_path / "vit_small.pth")
    shapes = r"shape mismatches, file vs model \(first: cls_token \(1, 1, 384\) vs \(1, 1, 192\)"
    with pytest.raises(IncompatibleWeights, match=r"vit_small\.pth does not fit .*" + shapes):
        create_backbone(VIT, pretrained=True, weights=path)


def test_a_shallower_cvt_is_rejected(tmp_path: Path) -> None:
    source_model = _cvt_classifier("cvt_13", seed=7)
    source_model.save_pretrained(tmp_path / "cvt-13")
    with pytest.raises(IncompatibleWeights, match=r"cvt-13/model\.safetensors does not fit microsoft/cvt-21.*missing"):
        create_backbone("cvt_21", pretrained=True, weights=tmp_path / "cvt-13")


def test_npz_for_a_model_without_a_big_vision_reader_is_rejected(vit_source: dict, tmp_path: Path) -> None:
    path = _write_augreg_npz(vit_source, num_heads=3, path=tmp_path / "vit.npz")
    with pytest.raises(IncompatibleWeights, match=r"vit\.npz.*only for timm ViT"):
        create_backbone(MOBILEVIT, pretrained=True, weights=path)


def test_npz_with_fewer_blocks_is_rejected(vit_source: dict, tmp_path: Path) -> None:
    shallow = {key: value for key, value in vit_source.items() if not key.startswith("blocks.11.")}
    path = _write_augreg_npz(shallow, num_heads=3, path=tmp_path / "shallow.npz")
    with pytest.raises(IncompatibleWeights, match=r"shallow\.npz does not fit"):
        create_backbone(VIT, pretrained=True, weights=path)


def test_a_file_that_is_not_weights_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.safetensors"
    path.write_text("not a tensor file")
    with pytest.raises(IncompatibleWeights, match="notes.safetensors: cannot read weights"):
        create_backbone(MOBILEVIT, pretrained=True, weights=path)
    unsupported = tmp_path / "weights.onnx"
    unsupported.write_bytes(b"\x00")
    with pytest.raises(IncompatibleWeights, match=r"weights\.onnx: unsupported weights format"):
        create_backbone(MOBILEVIT, pretrained=True, weights=unsupported)


def test_a_folder_with_several_weight_files_is_ambiguous(mobilevit_source: dict, tmp_path: Path) -> None:
    _save(mobilevit_source, tmp_path / "a.pth")
    _save(mobilevit_source, tmp_path / "b.pth")
    with pytest.raises(IncompatibleWeights, match="exactly one weight file.*a.pth, b.pth"):
        create_backbone(MOBILEVIT, pretrained=True, weights=tmp_path)


def test_a_fold_job_uses_the_planned_weights_or_says_why_it_cannot(mobilevit_source: dict, tmp_path: Path,
                                                                     tiny_config) -> None:
    """The plan decides the weights once; a node that finds another file under the same path refuses to train."""
    from pipeline.models.ordinal import OutputConfig
    from pipeline.runs.jobs.fold_decisions import DecisionNotHonoured
    from pipeline.runs.jobs.fold_job import build_network
    from pipeline.runs.jobs.fold_run import FoldJob

    path = _save(mobilevit_source, tmp_path / "mobilevit.safetensors", None)
    cfg = tiny_config(f"model={MOBILEVIT}", f"model.weights={path}", "model.pretrained=true")
    decisions = planned(cfg, tmp_path / "folds.csv")
    assert decisions.weights == {"kind": "file", "ref": str(path), "sha256": _sha256(path)}
    assert decisions.model_family == "timm" and decisions.precision == "32-true"
    softmax = OutputConfig.from_config(None)
    assert build_network(cfg.model.name, cfg.model.img_size, softmax, 2, decisions).backbone.family == "timm"
    changed = dict(mobilevit_source)
    first = next(iter(changed))
    changed[first] = changed[first] + 1
    _save(changed, path, None)  # another file at the planned path, as on a node with other weights
    with pytest.raises(DecisionNotHonoured, match="the plan chose weights file"):
        build_network(cfg.model.name, cfg.model.img_size, softmax, 2, decisions)
    job = FoldJob({}, 0, "parent", "sqlite://", str(tmp_path / "fold_0"), decisions)
    assert FoldJob.read(job.write(tmp_path / "job.json")) == job  # the decisions travel with the job, as written
