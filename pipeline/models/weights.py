"""Pretrained weight resolution: a local file or folder, else the Hugging Face hub cache, never a silent fallback.

The machines this pipeline runs on often have no internet, so nothing here downloads: the hub is only read through
its local cache (offline). Whatever is loaded is recorded as a `WeightsSource` (kind, reference, sha256) so every
run says which weights it started from.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache

from pipeline.utils.digests import file_sha256

logger = logging.getLogger(__name__)

STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt")
WEIGHT_SUFFIXES = (*STATE_DICT_SUFFIXES, ".npz")
# Hugging Face's default file names, in the order the hub libraries prefer them.
HUB_WEIGHT_FILENAMES = ("model.safetensors", "pytorch_model.bin")
PRETRAINED_MODES = (True, False, "auto")


@dataclass(frozen=True)
class WeightsSource:
    """Where a model's initial weights came from."""

    kind: str  # "hub" | "file" | "random"
    ref: str  # hub repo id, file path, or "" for random init
    sha256: str | None = None


RANDOM_INIT = WeightsSource(kind="random", ref="", sha256=None)


class WeightsUnavailable(RuntimeError):
    """Pretrained weights were asked for but are neither given as a file nor in the hub cache."""


class IncompatibleWeights(RuntimeError):
    """A weights file exists but cannot be read, or does not fit the architecture."""


_HOW_TO_PROVIDE = (
    "Provide weights one of these ways: `make <target> WEIGHTS=/path/to/weights` (file or folder); "
    "`model.weights=/path/to/weights` in the config or on the command line; or pre-populate the Hugging Face hub "
    "cache. Or train from random initialisation with pretrained=false (or pretrained=auto)."
)


@dataclass(frozen=True)
class ResolvedWeights:
    """A weight file to load, and the provenance to record for it."""

    path: Path
    source: WeightsSource


def resolve_weights(
    pretrained: bool | str,
    weights: str | os.PathLike | None,
    *,
    model_name: str,
    hub_repo: str | None,
    hub_filenames: Sequence[str] = HUB_WEIGHT_FILENAMES,
) -> ResolvedWeights | None:
    """Find the weights `pretrained` asks for; None means random initialisation.

    True: the given file/folder, else the hub cache, else WeightsUnavailable. False: random (a `weights` path is then
    an error, not something to ignore). "auto": like True, but a missing hub cache entry gives random init with a
    loud warning. A given path that does not exist is always an error, also under "auto".
    """
    if pretrained not in PRETRAINED_MODES or not isinstance(pretrained, (bool, str)):
        raise ValueError(f"pretrained must be one of True, False, 'auto'; got {pretrained!r}")
    if weights is not None and not str(weights).strip():
        weights = None  # an empty WEIGHTS= on the command line means "not given"
    if pretrained is False:
        if weights is not None:
            raise ValueError(
                f"weights={weights!s} was given with pretrained=False; set pretrained=true (or auto) "
                "to load it, or drop weights for random initialisation"
            )
        return None
    if weights is not None:
        path = weight_file(weights)
        return ResolvedWeights(path, WeightsSource(kind="file", ref=str(path), sha256=file_sha256(path)))
    try:
        return _from_hub_cache(model_name, hub_repo, hub_filenames)
    except WeightsUnavailable as missing:
        if pretrained is True:
            raise
        message = f"{missing} Falling back to RANDOM initialisation because pretrained='auto'."
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)
        return None


def _from_hub_cache(model_name: str, hub_repo: str | None, hub_filenames: Sequence[str]) -> ResolvedWeights:
    cache_dir = hub_cache_dir()
    if hub_repo is None:
        raise WeightsUnavailable(
            f"No pretrained weights for {model_name!r}: it has no Hugging Face hub repo, so only a local file works. "
            f"{_HOW_TO_PROVIDE}"
        )
    for filename in hub_filenames:
        cached = try_to_load_from_cache(hub_repo, filename, cache_dir=cache_dir)
        if isinstance(cached, str):
            path = Path(cached)
            return ResolvedWeights(path, WeightsSource(kind="hub", ref=hub_repo, sha256=file_sha256(path)))
    raise WeightsUnavailable(
        f"No pretrained weights for {model_name!r}: hub repo {hub_repo!r} ({' or '.join(hub_filenames)}) is not in "
        f"the Hugging Face cache at {cache_dir}, and this pipeline does not download. {_HOW_TO_PROVIDE} "
        f"For the hub cache: on a machine with internet run `hf download {hub_repo}` and copy its "
        f"HF_HOME here, or point HF_HOME / HF_HUB_CACHE at a cache that holds it."
    )


def hub_cache_dir() -> Path:
    """The hub cache folder, read from the environment now (huggingface_hub reads it once, at import)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(hf_constants.HF_HUB_CACHE)


def weight_file(weights: str | os.PathLike) -> Path:
    """The weight file itself: `weights` if it is a file, else the one weight file in the folder."""
    path = Path(weights).expanduser()
    if path.is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"weights path {path} does not exist")
    for name in HUB_WEIGHT_FILENAMES:
        if (path / name).is_file():
            return path / name
    candidates = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if len(candidates) != 1:
        found = ", ".join(p.name for p in candidates) or "none"
        raise IncompatibleWeights(
            f"weights folder {path} must hold exactly one weight file ({', '.join(WEIGHT_SUFFIXES)}); found: {found}"
        )
    return candidates[0]


def provenance_path(weights_file: str | os.PathLike) -> Path:
    """Where a weights file's provenance lies: `<file>.json` beside it (`<stem>.json`), as `make pretrain` writes it
    (the pool, every identity in it, the target, the SHA-256)."""
    return Path(weights_file).with_suffix(".json")


def weights_provenance(weights_file: str | os.PathLike) -> tuple[Path, dict | None]:
    """A weights file's provenance file and its content; None when there is none. One that cannot be read as a JSON
    object is an error naming it (IncompatibleWeights): it would otherwise pass for a file without provenance."""
    path = provenance_path(weights_file)
    if not path.is_file():
        return path, None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IncompatibleWeights(f"{path}: the provenance of {weights_file} cannot be read ({error}); fix or "
                                  f"remove it") from error
    if not isinstance(content, dict):
        raise IncompatibleWeights(f"{path}: the provenance of {weights_file} is not a JSON object")
    return path, content


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors / .pth / .bin / .pt file, unwrapped from a "state_dict" or "model" entry.

    A "module." prefix on every key (DistributedDataParallel) is removed. Pickled files are read with
    weights_only=True, so a file cannot run code.
    """
    path = Path(path)
    if path.suffix not in STATE_DICT_SUFFIXES:
        raise IncompatibleWeights(
            f"{path}: unsupported weights format {path.suffix!r}; expected one of {', '.join(STATE_DICT_SUFFIXES)}"
        )
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: object = load_file(str(path), device="cpu")
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # each format raises its own error types for a corrupt file
        raise IncompatibleWeights(f"{path}: cannot read weights ({type(error).__name__}: {error})") from error
    for wrapper in ("state_dict", "model"):
        if isinstance(loaded, Mapping) and isinstance(loaded.get(wrapper), Mapping):
            loaded = loaded[wrapper]
    if not isinstance(loaded, Mapping) or not loaded:
        raise IncompatibleWeights(f"{path}: expected a state dict (name -> tensor), got {type(loaded).__name__}")
    not_tensors = [key for key, value in loaded.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise IncompatibleWeights(f"{path}: entries that are not tensors, e.g. {not_tensors[:3]}")
    state_dict = {str(key): value for key, value in loaded.items()}
    if all(key.startswith("module.") for key in state_dict):
        state_dict = {key.removeprefix("module."): value for key, value in state_dict.items()}
    return state_dict


def without_prefixes(state_dict: Mapping[str, torch.Tensor], prefixes: Sequence[str]) -> dict[str, torch.Tensor]:
    """Drop the entries of modules named in `prefixes` (e.g. the source classifier head, which is never reused)."""
    return {
        key: value
        for key, value in state_dict.items()
        if not any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)
    }


# BatchNorm's batch counter: torch fills it in when a checkpoint lacks it, and it is no weight worth naming first.
_BATCH_COUNTER = "num_batches_tracked"


def check_state_dict_fits(
    expected: Mapping[str, torch.Tensor],
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    architecture: str,
    *,
    shown: int = 5,
) -> None:
    """Raise IncompatibleWeights naming the file and the first missing / unexpected / misshapen keys."""
    missing = [key for key in expected if key not in state_dict and not key.endswith(_BATCH_COUNTER)]
    unexpected = sorted(
        (key for key in state_dict if key not in expected), key=lambda key: key.endswith(_BATCH_COUNTER)
    )
    misshapen = [
        f"{key} {tuple(state_dict[key].shape)} vs {tuple(value.shape)}"
        for key, value in expected.items()
        if key in state_dict and state_dict[key].shape != value.shape
    ]
    problems = [
        f"{len(found)} {what} (first: {', '.join(found[:shown])})"
        for what, found in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches, file vs model", misshapen),
        )
        if found
    ]
    if problems:
        raise IncompatibleWeights(f"{path} does not fit {architecture}: " + "; ".join(problems))
