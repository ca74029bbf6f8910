"""The ViT course notebooks run top to bottom in a fresh kernel, and state what the course says.

Each notebook collects what it states in a dict `facts`; the test executes the notebook (in memory: the file is not
rewritten), reads `facts` back through one extra cell and checks every statement against numbers worked out here,
from the paper's sizes and the equations, not copied from the notebook's output.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import nbformat
import pytest
from nbclient import NotebookClient

from pipeline.utils.paths import PROJECT_ROOT

NOTEBOOK_DIR = PROJECT_ROOT / "notebooks"


def run_notebook(name: str) -> dict:
    """Execute notebooks/<name>.ipynb and return its `facts`; any error in a cell fails the test."""
    path = NOTEBOOK_DIR / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("import json\nprint(json.dumps(facts))"))
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    # One thread per kernel: the notebooks' tensors are small, and a busy CPU makes oversubscribed OpenMP slow.
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    output = "".join(out.get("text", "") for out in notebook.cells[-1].outputs if out.output_type == "stream")
    return json.loads(output)


def vit_parameters(image: int, patch: int, width: int, depth: int, mlp: int, classes: int, channels: int = 3) -> int:
    """Eqs. 1-4 counted: patch embedding, class token, position embeddings, blocks, final norm, head."""
    tokens = (image // patch) ** 2 + 1
    block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width) + 2 * width * mlp + mlp + width
    return (patch * patch * channels * width + width) + width + tokens * width + depth * block + 2 * width + (
        width * classes + classes
    )


def check_tiny_vit_on_a_face(facts: dict) -> None:
    assert facts["patches"] == (224 // 32) ** 2 == 49
    assert facts["tokens"] == 50
    assert facts["parameters"] == vit_parameters(224, 32, 8, 2, 32, 2) == 26_770
    assert facts["attention_shape"] == [1, 2, 50, 50]
    assert facts["pca_embedding_max_error"] < 1e-9, "the patch embedding is the projection onto 8 components"
    assert facts["head_slices_max_error"] < 1e-12, "head 1 reads features 1-4, head 2 features 5-8"
    assert all(abs(total - 1) < 1e-12 for total in facts["attention_row_sums"])
    assert facts["logits_vs_timm"] < 1e-10 and facts["attention_vs_timm"] < 1e-12
    assert facts["logits_vs_numpy"] < 1e-10
    assert len(facts["logits"]) == 2


def check_patches_and_embeddings(facts: dict) -> None:
    assert facts["patch_counts"] == {str(p): 224 * 224 // p**2 for p in (56, 32, 16, 8)}
    assert facts["patch_counts"]["16"] == 196 and facts["patch_counts"]["8"] == 784
    assert facts["patch_lengths"]["16"] == 768
    assert facts["conv_equals_projection_max_error"] < 1e-9
    errors = [facts["rebuild_relative_error"][d] for d in ("1", "4", "16", "64", "195")]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.1, "more dimensions keep more of the patch"
    assert errors[-1] < 1e-9, "196 centred patches span at most 195 dimensions"
    assert facts["vit_b16_patch_embedding_parameters"] == 590_592
    assert facts["vit_b16_parameters"] == vit_parameters(224, 16, 768, 12, 3072, 1000) == 86_567_656  # as timm's
    assert facts["vit_b16_class_and_position_parameters"] == 768 + 197 * 768
    assert facts["tokens_with_class_token"] == 197
    assert facts["class_token_input_difference"] == 0.0, "before attention the class token holds no image content"
    assert facts["class_token_output_difference"] > 1e-3
    assert facts["random_position_mean_abs_similarity"] < 0.1
    assert facts["sinusoidal_similarity_neighbours"] > facts["sinusoidal_similarity_far"] + 0.2
    assert facts["sinusoidal_similarity_same_row_or_column"] > facts["sinusoidal_similarity_other"] + 0.2
    # the permutation property
    assert facts["class_token_change_without_positions"] < 1e-12
    assert facts["patch_outputs_permuted_without_positions"] < 1e-12
    assert facts["class_token_change_with_positions"] > 1e-4


def check_attention(facts: dict) -> None:
    assert all(abs(total - 1) < 1e-12 for total in facts["four_token_row_sums"])
    assert facts["four_token_vs_fused_kernel"] < 1e-12 and facts["four_token_vs_reference_module"] < 1e-12
    for head_dim in ("4", "16", "64", "256", "1024"):  # the scaling: sd sqrt(Dh) before, 1 after
        assert facts["score_sd_unscaled"][head_dim] == pytest.approx(math.sqrt(int(head_dim)), rel=0.05)
        assert facts["score_sd_scaled"][head_dim] == pytest.approx(1.0, rel=0.05)
        assert facts["largest_weight_scaled"][head_dim] < 0.2
    unscaled = [facts["largest_weight_unscaled"][h] for h in ("4", "16", "64", "256", "1024")]
    assert unscaled == sorted(unscaled) and unscaled[-1] > 0.9, "unscaled, the softmax ends up on one key"
    for distances in facts["mean_attention_distance_px"].values():
        assert distances["local"] < 16 < 3 * distances["local"], "the local head looks about one patch away"
        assert distances["appearance"] > 4 * distances["local"] and distances["detail"] > 4 * distances["local"]
    assert facts["vit_b16_block_parameters"] == {
        "attention": 4 * 768**2 + 4 * 768, "MLP": 2 * 768 * 3072 + 3072 + 768, "two LayerNorms": 4 * 768,
        "block": 7_087_872,
    }
    assert facts["vit_b16_block_parameters"]["attention"] == 2_362_368
    assert facts["vit_b16_mlp_share"] == pytest.approx(2 / 3, abs=0.01)
    assert facts["gelu_minimum_x"] == pytest.approx(-0.7518, abs=1e-3)
    assert facts["gelu_minimum"] == pytest.approx(-0.16997, abs=1e-4)
    assert facts["gelu_numpy_vs_torch"] < 1e-12
    phi, density = 0.5 * (1 + math.erf(-1 / math.sqrt(2))), math.exp(-0.5) / math.sqrt(2 * math.pi)
    assert facts["gelu_gradient_at_minus_1"] == pytest.approx(phi - density)  # d/dx x Phi(x) at -1: non-zero
    assert facts["relu_gradient_at_minus_1"] == 0.0


def check_higher_resolution(facts: dict) -> None:
    assert facts["tokens"] == {"224": 14 * 14 + 1, "384": 24 * 24 + 1}
    assert facts["attention_entries_ratio"] == pytest.approx(577**2 / 197**2)
    cost = {t: 12 * t * 768**2 + 2 * t**2 * 768 for t in (197, 577)}
    assert facts["block_cost_ratio"] == pytest.approx(cost[577] / cost[197])
    assert facts["attention_share_of_block_cost"]["384"] > facts["attention_share_of_block_cost"]["224"]
    assert facts["interpolated_shape"] == [1, 577, 768]
    assert facts["interpolation_vs_timm"] < 1e-6 and facts["class_token_row_change"] == 0.0
    assert facts["position_embeddings_384"] == [1, 577, 192]
    assert facts["logits_384_vs_timm"] < 1e-4


CHECKS: dict[str, Callable[[dict], None]] = {
    "vit_course_0_tiny_vit_on_a_face": check_tiny_vit_on_a_face,
    "vit_course_2_patches_and_embeddings": check_patches_and_embeddings,
    "vit_course_5_attention": check_attention,
    "vit_course_9_higher_resolution": check_higher_resolution,
}


def test_every_course_notebook_has_its_checks() -> None:
    assert {path.stem for path in NOTEBOOK_DIR.glob("vit_course_*.ipynb")} == set(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_course_notebook_runs_and_states_the_facts(name: str) -> None:
    CHECKS[name](run_notebook(name))


def test_committed_notebooks_are_executed_and_error_free() -> None:
    """`make notebooks` writes the outputs back: what the repository shows is what the code printed."""
    for name in CHECKS:
        notebook = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
        code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert all(cell.execution_count is not None for cell in code_cells), f"{name} has cells never run"
        assert not any(out.output_type == "error" for cell in code_cells for out in cell.outputs), name
