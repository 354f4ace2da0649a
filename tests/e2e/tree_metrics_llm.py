"""Run as a script by `test_tree_metrics.py`: an `LLM` in vLLM's default multiprocess mode (engine core in its own
process) with the README's MTP tree under a small token budget; prints its tree and spec-decode metrics from
`LLM.get_metrics()` as one JSON line. A script, because the e2e suite's own process runs engines in-process."""

import json
import sys

RESULT = "TREE_METRICS "
# More decoding requests than whole [2, 2, 1] trees (1 + 10 tokens each) fit the step's budget: some fall back.
BUDGET = dict(max_num_seqs=4, max_num_batched_tokens=32)
MTP_TREE = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct",
            "draft_tree_widths": [2, 2, 1]}
PROMPTS = ["Beautiful is better than ugly.", "Simple is better than complex.", "Flat is better than nested.",
           "Readability counts."]


def main(model: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_treewy.vllm_plugin.testing.equivalence import ENGINE_DEFAULTS

    llm = LLM(model=model, speculative_config=MTP_TREE, **{**ENGINE_DEFAULTS, **BUDGET})
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    metrics = [{"name": m.name, "labels": m.labels, "value": getattr(m, "value", None),
                "values": getattr(m, "values", None)}
               for m in llm.get_metrics() if "treewy" in m.name or m.name.startswith("vllm:spec_decode")]
    client = type(llm.llm_engine.engine_core).__name__  # InprocClient when the engine core runs in this process
    print(RESULT + json.dumps({"engine_core_client": client, "metrics": metrics}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable without running
    main(sys.argv[1])
