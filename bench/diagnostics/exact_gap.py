"""Where two engines part by more than a bf16 tie, which token does the model itself prefer?

Runs the CPU fixture through transformers' own Qwen3.5 in fp64, fp32 and bf16: the greedy continuation of one
fixture prompt up to a position, and there the logit gap between the reference engine's token and the other one.

    PYTHONPATH=. python bench/diagnostics/exact_gap.py PROMPT POSITION REFERENCE_TOKEN OTHER_TOKEN
    e.g. PYTHONPATH=. python bench/diagnostics/exact_gap.py 17 3 137 287     (issue 8's prompt 17)
"""

import sys
import tempfile

import torch
from transformers import AutoTokenizer, Qwen3_5ForCausalLM

from tests.e2e.conftest import NUM_PROMPTS
from vllm_treewy.fixture import build_fixture, fixture_prompts


def main(prompt_index: int, position: int, reference_token: int, other_token: int) -> None:
    model_dir = build_fixture(tempfile.mkdtemp())
    prompt = fixture_prompts(AutoTokenizer.from_pretrained(model_dir), NUM_PROMPTS)[prompt_index]
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        ids = list(prompt)
        with torch.no_grad():
            for t in range(position + 1):
                logits = model(torch.tensor([ids])).logits[0, -1].double()
                if t < position:
                    ids.append(int(logits.argmax()))
        top2 = logits.topk(2)
        print(f"{dtype}: greedy {ids[len(prompt):]} | at {position}: logit[{reference_token}] - logit[{other_token}]"
              f" = {(logits[reference_token] - logits[other_token]).item():+.5f}; top two {top2.indices.tolist()} "
              f"{[round(v, 5) for v in top2.values.tolist()]}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
