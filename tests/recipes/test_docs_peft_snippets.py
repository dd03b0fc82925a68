"""The docs' PEFT snippets, run as written against real tiny LoRA exports (issue 38, finding 9).

``docs/quickstart.md`` and ``docs/lora.md`` tell a user how to load a run's adapter with PEFT.
These tests take the snippet text out of the ``.md`` files, run it on a real export of the
embedded dense model (``tiny/lora``) and of the embedded MoE model (``tiny/moe_lora``), and
compare its logits with those of the merged export, loaded the way the docs load it. A base
model stored in another dtype than the one its configs train in (the tiny MoE was bfloat16,
trained in fp32: logits 0.11-0.14 apart) fails here, and so does a snippet that no longer runs.
"""

import re
from pathlib import Path

import pytest
import torch

from tests.recipes.conftest import tunelab_run
from tests.recipes.moe_runs import peft_loads_experts
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs"
# The paths docs/quickstart.md uses; the tests put a tiny run's in their place.
QUICKSTART_BASE = "/tmp/Llama-3.2-1B-Instruct"
QUICKSTART_OUTPUT = "outputs/llama3_2_1B_lora"
# Merged and adapted differ by the order of fp32 roundings only (W x + B A x against
# (W + B A) x, over 3 layers): a few units of fp32's 2**-23 relative step on logits up to 13
# (measured on the MoE run here: 6.2e-6); a base read in bfloat16 (2**-8) is 7e-2 away.
FP32_LOGITS_ATOL = 1e-4


def python_blocks(markdown: Path) -> list[str]:
    """The ```` ```python ```` blocks of ``markdown``, in order."""
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.S)


def run_snippet(code: str, **names: object):
    """Execute ``code`` with ``names`` defined and return the ``model`` it made."""
    namespace = dict(names)
    exec(compile(code, "<docs snippet>", "exec"), namespace)
    return namespace["model"]


def quickstart_snippets(base: Path, output_dir: Path) -> tuple[str, str]:
    """docs/quickstart.md's merged-export and adapter snippets, pointed at ``output_dir``."""
    blocks = python_blocks(DOCS / "quickstart.md")
    merged = [b for b in blocks if 'epoch_0")' in b and "PeftModel" not in b]
    adapted = [b for b in blocks if "PeftModel.from_pretrained" in b]
    assert len(merged) == 1 and len(adapted) == 1, "docs/quickstart.md: the snippets moved"
    assert QUICKSTART_BASE in adapted[0] and QUICKSTART_OUTPUT in adapted[0]

    def pointed(code: str) -> str:
        return code.replace(QUICKSTART_BASE, str(base)).replace(QUICKSTART_OUTPUT, str(output_dir))

    return pointed(merged[0]), pointed(adapted[0])


def logits(model) -> torch.Tensor:
    """``model``'s logits on a fixed batch of 2 rows of 24 token ids of the tiny vocabulary."""
    ids = torch.randint(3, 810, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def assert_adapter_matters(merged: torch.Tensor, base: Path) -> None:
    """The trained adapter moves the logits (else any loading would match the merge)."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert (merged - logits(plain.eval())).abs().max() > 100 * FP32_LOGITS_ATOL


def test_quickstart_peft_snippet_gives_the_merged_logits_on_the_tiny_model(lora_1p):
    base = assets_dir() / "tiny"
    merged_code, adapted_code = quickstart_snippets(base, lora_1p)
    merged = logits(run_snippet(merged_code))
    adapted = logits(run_snippet(adapted_code))
    assert_adapter_matters(merged, base)
    torch.testing.assert_close(adapted, merged, rtol=0, atol=FP32_LOGITS_ATOL)


@pytest.fixture(scope="module")
def moe_lora_run(tmp_path_factory) -> Path:
    """``tiny/moe_lora`` on 1 process, 2 steps (LoRA on the experts too where PEFT loads it)."""
    out = tmp_path_factory.mktemp("docs_moe") / "run"
    targets = "q_proj,k_proj,v_proj,o_proj"
    if peft_loads_experts():
        targets += ",experts.gate_up_proj,experts.down_proj"
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", "schedule.epochs=1",
        "schedule.max_steps_per_epoch=2", "~val_dataset", "lr_scheduler.num_warmup_steps=0",
        f"lora.targets=[{targets}]", nproc=1,
    )  # fmt: skip
    return out


def test_lora_md_peft_snippet_gives_the_merged_logits_on_the_tiny_moe(moe_lora_run, monkeypatch):
    base = assets_dir() / "tiny_moe"
    # docs/lora.md: "Load it with PEFT: `PeftModel.from_pretrained(...(base), "epoch_0/adapter")`",
    # relative to the run's output_dir.
    snippets = re.findall(r"`(PeftModel\.from_pretrained\([^`]*)`", (DOCS / "lora.md").read_text())
    assert len(snippets) == 1, "docs/lora.md: the PEFT snippet moved"
    merged_code, _ = quickstart_snippets(base, moe_lora_run)
    monkeypatch.chdir(moe_lora_run)
    adapted = logits(
        run_snippet(
            f"model = {snippets[0]}",
            PeftModel=peft.PeftModel,
            AutoModelForCausalLM=transformers.AutoModelForCausalLM,
            base=str(base),
        )
    )
    merged = logits(run_snippet(merged_code))
    assert_adapter_matters(merged, base)
    torch.testing.assert_close(adapted, merged, rtol=0, atol=FP32_LOGITS_ATOL)
