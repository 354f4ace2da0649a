"""`mamba_state_commit` and `draft_tree_widths` on vLLM's SpeculativeConfig: one clear error per bad config, at
config creation (in the front end, before any engine core or worker exists), from Python and from the
`vllm serve` command line; valid configs build, hash, pickle and select the V1 model runner for reconstruct.

Only configs are built here (no engine), so the module runs in seconds. The plugin is loaded the way vLLM loads
it: `EngineArgs.__post_init__` calls `vllm.plugins.load_general_plugins()`, which runs our `register()` through
the `vllm.general_plugins` entry point; `install()` is idempotent, so no test depends on another having run first.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_treewy.fixture import build_fixture

K = 3


def mtp(k: int = K, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **extra}


TREE_DRAFTER = {"method": "custom_class", "num_speculative_tokens": K,
                "model": "vllm_treewy.vllm_plugin.testing.continuation_drafter.ContinuationTreeDrafter"}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory) -> str:
    return str(build_fixture(tmp_path_factory.mktemp("qwen35-tiny")))


@pytest.fixture(scope="module")
def no_gdn_model(fixture_model, tmp_path_factory) -> str:
    """The fixture with every layer declared full attention: same architecture and checkpoint, no GDN layer.

    Only configs are built from it (the GDN weights in the checkpoint would not load into attention layers).
    """
    out = tmp_path_factory.mktemp("qwen35-tiny-no-gdn") / "model"
    shutil.copytree(fixture_model, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    config_path.write_text(json.dumps(config, indent=2))
    return str(out)


def engine_config(model: str, speculative_config: dict | None):
    """What `LLM(...)` and `vllm serve` both do in the front end before they start an engine core."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model,
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=512,
        speculative_config=None if speculative_config is None else dict(speculative_config),
    ).create_engine_config()


def cli_engine_config(model: str, speculative_config: dict):
    """The `vllm serve MODEL --speculative-config '{...}'` path: vLLM's own server parser, then the engine config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model", model,
            "--dtype", "bfloat16",
            "--no-enable-prefix-caching",
            "--max-model-len", "512",
            "--speculative-config", json.dumps(speculative_config),
        ]
    )
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


# (id, speculative config, regex the message must match), all on the GDN fixture.
BAD_CONFIGS = [
    ("unknown-strategy", mtp(mamba_state_commit="snapshot"), "mamba_state_commit.*'store_all' or 'reconstruct'"),
    ("width-zero", mtp(draft_tree_widths=[1, 0, 1]), r"draft_tree_widths must be .*positive integers.*\[1, 0, 1\]"),
    ("width-negative", mtp(draft_tree_widths=[1, -2, 1]), r"draft_tree_widths must be .*positive integers"),
    ("widths-empty", mtp(draft_tree_widths=[]), r"draft_tree_widths must be a non-empty list"),
    ("width-fraction", mtp(draft_tree_widths=[1, 1.5, 1]), r"draft_tree_widths.*valid integer"),
    ("width-string", mtp(draft_tree_widths=["two", 1, 1]), r"draft_tree_widths.*valid integer"),
    ("widths-not-a-list", mtp(draft_tree_widths=3), r"draft_tree_widths.*valid list"),
    ("too-few-levels", mtp(draft_tree_widths=[1, 1]), r"2 levels but num_speculative_tokens is 3"),
    ("too-many-levels", mtp(draft_tree_widths=[1, 1, 1, 1]), r"4 levels but num_speculative_tokens is 3"),
    ("tree-ngram", {**NGRAM, "draft_tree_widths": [2, 1, 1]}, r"draft trees .*need method mtp or custom_class"),
    ("threshold-negative", mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1],
                               draft_tree_max_batch_size=-1),
     r"draft_tree_max_batch_size must be an integer >= 0, 'auto' or None, got -1"),
    ("threshold-unknown-word", mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1],
                                   draft_tree_max_batch_size="adaptive"),
     r"draft_tree_max_batch_size must be an integer >= 0, 'auto' or None, got 'adaptive'"),
    ("auto-on-a-chain", mtp(mamba_state_commit="reconstruct", draft_tree_max_batch_size="auto"),
     r"draft_tree_max_batch_size=auto needs a draft tree"),
    ("auto-store-all", mtp(draft_tree_widths=[2, 2, 1], draft_tree_max_batch_size="auto"),
     r"draft_tree_max_batch_size=auto needs method 'mtp' and mamba_state_commit='reconstruct'"),
    ("threshold-on-a-chain", mtp(mamba_state_commit="reconstruct", draft_tree_max_batch_size=4),
     r"draft_tree_max_batch_size=4 needs a draft tree"),
    ("threshold-store-all", mtp(draft_tree_widths=[2, 2, 1], draft_tree_max_batch_size=4),
     r"draft_tree_max_batch_size=4 needs method 'mtp' and mamba_state_commit='reconstruct'.*'store_all'"),
    ("threshold-custom-drafter", {**TREE_DRAFTER, "draft_tree_widths": [2, 1, 1], "mamba_state_commit": "reconstruct",
                                  "draft_tree_max_batch_size": 4},
     r"draft_tree_max_batch_size=4 needs method 'mtp'.*got method='custom_class'"),
    ("tree-with-a-user-schedule", mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1],
                                      num_speculative_tokens_per_batch_size=[(1, 4, 10)]),
     r"num_speculative_tokens_per_batch_size=\[\(1, 4, 10\)\] with draft_tree_widths=\[2, 2, 1\].*set "
     r"draft_tree_max_batch_size instead"),
    ("threshold-and-a-user-schedule", mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1],
                                          draft_tree_max_batch_size=2,
                                          num_speculative_tokens_per_batch_size=[(1, 2, 10), (3, 8, 2)]),
     r"draft_tree_max_batch_size=2 sets the schedule itself; give one or the other"),
    ("reconstruct-ngram", {**NGRAM, "mamba_state_commit": "reconstruct"},
     r"mamba_state_commit='reconstruct' supports method mtp or custom_class, got method='ngram'"),
]


def assert_one_clear_error(excinfo) -> None:
    """One exception whose message names the problem; a pydantic ValidationError must hold exactly one error."""
    from pydantic import ValidationError

    err = excinfo.value
    if isinstance(err, ValidationError):
        assert err.error_count() == 1, str(err)
    else:
        # Not wrapped by pydantic (NotImplementedError passes through __post_init__ unwrapped): still one error.
        assert isinstance(err, NotImplementedError), repr(err)
    # Raised while the config was built, so no engine core / worker process was ever started.
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("spec,match", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_fails_at_config_creation(fixture_model, spec, match):
    # (?s): pydantic puts the field name and its message on separate lines.
    with pytest.raises((ValueError, NotImplementedError), match="(?s)" + match) as excinfo:
        engine_config(fixture_model, spec)
    assert_one_clear_error(excinfo)


def test_ngram_builds_on_the_fixture(fixture_model):
    """The reconstruct-with-ngram refusal is about reconstruct: ngram itself is fine on this model (an ngram
    engine also generates on it; checked by hand, not here, to keep this module fast)."""
    config = engine_config(fixture_model, NGRAM)
    assert config.speculative_config.method == "ngram"
    assert config.speculative_config.mamba_state_commit == "store_all"


def test_reconstruct_without_gdn_layers_fails(no_gdn_model):
    # The variant is a valid model config: store_all (vLLM's behaviour) still builds on it.
    stock = engine_config(no_gdn_model, mtp())
    assert "linear_attention" not in stock.model_config.hf_text_config.layer_types
    assert stock.speculative_config.mamba_state_commit == "store_all"

    match = r"mamba_state_commit='reconstruct' needs a model with Gated DeltaNet"
    with pytest.raises(ValueError, match=match) as excinfo:
        engine_config(no_gdn_model, mtp(mamba_state_commit="reconstruct"))
    assert_one_clear_error(excinfo)


@pytest.mark.parametrize(
    "spec,match",
    [
        (mtp(mamba_state_commit="snapshot"), "mamba_state_commit"),
        (mtp(draft_tree_widths=[1, 0, 1]), "positive integers"),
        ({**NGRAM, "draft_tree_widths": [2, 1, 1]}, "need method mtp or custom_class"),
        ({**NGRAM, "mamba_state_commit": "reconstruct"}, "supports method mtp"),
    ],
    ids=["unknown-strategy", "width-zero", "tree-ngram", "reconstruct-ngram"],
)
def test_bad_config_from_serve_command_line(fixture_model, spec, match):
    """The same errors through `vllm serve`'s argument parser (whose construction must survive the new fields)."""
    with pytest.raises((ValueError, NotImplementedError), match="(?s)" + match) as excinfo:
        cli_engine_config(fixture_model, spec)
    assert_one_clear_error(excinfo)


def test_serve_command_line_builds_reconstruct(fixture_model):
    config = cli_engine_config(fixture_model, mtp(mamba_state_commit="reconstruct", draft_tree_widths=[1, 1, 1]))
    assert config.speculative_config.mamba_state_commit == "reconstruct"
    assert config.speculative_config.draft_tree_widths == [1, 1, 1]


def test_serve_argparse_kwargs_for_new_fields():
    """`vllm serve` builds argparse kwargs for every SpeculativeConfig field (`get_kwargs`) before it parses
    anything: the new fields' annotations must be real types there, not strings."""
    from vllm.engine.arg_utils import get_kwargs

    from vllm_treewy.vllm_plugin.config import TreewySpeculativeConfig

    kwargs = get_kwargs(TreewySpeculativeConfig)
    assert sorted(kwargs["mamba_state_commit"]["choices"]) == ["reconstruct", "store_all"]
    assert kwargs["mamba_state_commit"]["default"] == "store_all"
    assert kwargs["draft_tree_widths"]["default"] is None


@pytest.mark.parametrize(
    "spec,commit,widths",
    [
        (mtp(), "store_all", None),
        (mtp(mamba_state_commit="store_all"), "store_all", None),
        (mtp(mamba_state_commit="reconstruct"), "reconstruct", None),
        (mtp(1, mamba_state_commit="reconstruct", draft_tree_widths=[1]), "reconstruct", [1]),
        (mtp(4, mamba_state_commit="reconstruct", draft_tree_widths=[1, 1, 1, 1]), "reconstruct", [1, 1, 1, 1]),
        (mtp(draft_tree_widths=[1, 1, 1]), "store_all", [1, 1, 1]),
    ],
    ids=["default", "store_all", "reconstruct", "reconstruct-k1-chain", "reconstruct-k4-chain", "store_all-chain"],
)
def test_valid_config_builds(fixture_model, spec, commit, widths):
    from vllm_treewy.vllm_plugin.config import TreewySpeculativeConfig

    config = engine_config(fixture_model, spec)
    spec_config = config.speculative_config
    assert isinstance(spec_config, TreewySpeculativeConfig)
    assert spec_config.mamba_state_commit == commit
    assert spec_config.draft_tree_widths == widths
    assert spec_config.num_speculative_tokens == spec["num_speculative_tokens"]
    assert spec_config.reconstructs_mamba_state == (commit == "reconstruct")


@pytest.mark.parametrize("commit", ["store_all", "reconstruct"])
def test_a_tree_builds_with_either_strategy_on_cpu(fixture_model, commit):
    """store_all is the default strategy, so a tree without one is the store_all baseline (CPU only)."""
    spec = {**TREE_DRAFTER, "draft_tree_widths": [2, 1, 1]}
    if commit == "reconstruct":
        spec["mamba_state_commit"] = commit
    spec_config = engine_config(fixture_model, spec).speculative_config
    assert spec_config.mamba_state_commit == commit and spec_config.draft_tree_widths == [2, 1, 1]
    assert spec_config.num_speculative_tokens == 6  # vLLM schedules all N nodes; the depth stays in the widths


def test_a_tree_says_what_vllms_figures_count():
    """vLLM prints num_speculative_tokens (the N nodes) and rates over N node slots for a tree: the plugin's start-up
    line says so, with the depth the user wrote and which per-position series are depths."""
    from vllm_treewy.vllm_plugin.config import tree_metrics_note

    note = tree_metrics_note([2, 2, 1], 3, 10)
    assert "depth 3 with 10 nodes" in note and "num_speculative_tokens=10" in note
    assert "0..2 are depths 1..3" in note and "over 10 nodes per verify" in note


def test_a_store_all_tree_is_refused_off_cpu(fixture_model, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    with pytest.raises(ValueError, match="(?s)store_all tree .*runs on vLLM's CPU backend only") as excinfo:
        engine_config(fixture_model, {**TREE_DRAFTER, "draft_tree_widths": [2, 1, 1]})
    assert_one_clear_error(excinfo)


@pytest.mark.parametrize("setting", [{"draft_sample_method": "probabilistic"}, {"use_local_argmax_reduction": True}])
def test_a_tree_refuses_draft_settings_that_never_form_the_logits(fixture_model, setting):
    """A tree's children are each node's most likely tokens from the head's logits (V2's first pass gives the
    root's): sampled drafts and the local argmax reduction do not give them."""
    spec = {**TREE_DRAFTER, "draft_tree_widths": [2, 1, 1], "mamba_state_commit": "reconstruct", **setting}
    with pytest.raises(ValueError, match="most likely tokens from the head's logits") as excinfo:
        engine_config(fixture_model, spec)
    assert_one_clear_error(excinfo)


def test_no_speculation_is_untouched(fixture_model):
    assert engine_config(fixture_model, None).speculative_config is None


def test_compute_hash(fixture_model):
    store_all = engine_config(fixture_model, mtp(mamba_state_commit="store_all"))
    reconstruct = engine_config(fixture_model, mtp(mamba_state_commit="reconstruct"))
    reconstruct_again = engine_config(fixture_model, mtp(mamba_state_commit="reconstruct"))
    chain = engine_config(fixture_model, mtp(draft_tree_widths=[1, 1, 1]))
    chain_again = engine_config(fixture_model, mtp(draft_tree_widths=[1, 1, 1]))

    def spec_hash(c):
        return c.speculative_config.compute_hash()

    # The strategies compute different things in the GDN layers and allocate different state: MUST differ, in the
    # speculative config's hash and in the VllmConfig hash that keys vLLM's compile cache.
    assert spec_hash(store_all) != spec_hash(reconstruct)
    assert store_all.compute_hash() != reconstruct.compute_hash()
    # A function of the values, not of the objects.
    assert spec_hash(reconstruct) == spec_hash(reconstruct_again)
    assert reconstruct.compute_hash() == reconstruct_again.compute_hash()
    assert spec_hash(chain) == spec_hash(chain_again)
    # (vLLM's own hash leaves num_speculative_tokens out: it keys the graph from inputs to hidden states.)
    # Widths None vs [1, 1, 1]: deliberately not asserted either way. Both are the same chain and run the same
    # code today, so equal hashes would be allowed; but the hash keys compile caches, where a spurious difference
    # only costs a cache miss while a spurious equality would reuse the wrong graph, and once trees land the
    # widths will change the graph. Hashing the widths as given (the plugin's choice: they differ) is the safe side.


def test_reconstruct_chains_and_trees_run_on_the_v2_runner(fixture_model):
    """vLLM picks Model Runner V2 unless its feature check lists something: reconstruct chains and draft trees list
    nothing (they run there: v2.accepted_counts, v2.runner)."""
    for config in (mtp(mamba_state_commit="reconstruct"), mtp(mamba_state_commit="reconstruct", k=1),
                   mtp(mamba_state_commit="reconstruct", draft_tree_widths=[1, 1, 1]),
                   mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1]),
                   mtp(mamba_state_commit="store_all")):
        assert engine_config(fixture_model, config)._get_v2_model_runner_unsupported_features() == []


def test_config_pickles(fixture_model):
    from vllm_treewy.vllm_plugin.config import TreewySpeculativeConfig

    config = engine_config(fixture_model, mtp(mamba_state_commit="reconstruct", draft_tree_widths=[1, 1, 1]))
    clone = pickle.loads(pickle.dumps(config))
    assert isinstance(clone.speculative_config, TreewySpeculativeConfig)
    assert clone.speculative_config.mamba_state_commit == "reconstruct"
    assert clone.speculative_config.draft_tree_widths == [1, 1, 1]
    assert clone.speculative_config.compute_hash() == config.speculative_config.compute_hash()
    assert clone.compute_hash() == config.compute_hash()


UNPICKLE_IN_FRESH_PROCESS = """
import pickle, sys
config = pickle.loads(sys.stdin.buffer.read())
import vllm.plugins
spec = config.speculative_config
print(type(spec).__module__, type(spec).__name__, spec.mamba_state_commit, spec.draft_tree_widths,
      vllm.plugins.plugins_loaded, config.compute_hash())
"""


def test_config_unpickles_before_plugins_load(fixture_model, tmp_path):
    """The engine core unpickles VllmConfig before it loads plugins: a fresh interpreter, no plugin loaded."""
    config = engine_config(fixture_model, mtp(mamba_state_commit="reconstruct", draft_tree_widths=[1, 1, 1]))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run(
        [sys.executable, "-c", UNPICKLE_IN_FRESH_PROCESS],
        input=pickle.dumps(config),
        capture_output=True,
        env=env,
        cwd=Path(__file__).parent,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    last_line = result.stdout.decode().strip().splitlines()[-1].split()
    assert last_line == [
        "vllm_treewy.vllm_plugin.config", "TreewySpeculativeConfig", "reconstruct", "[1,", "1,", "1]",
        "False", config.compute_hash(),
    ]


@pytest.mark.parametrize("widths,num_nodes", [([2, 1, 1], 6), ([2, 2, 1], 10), ([3, 2, 2], 21), ([4, 2], 12)])
def test_tree_config_schedules_every_node(fixture_model, widths, num_nodes):
    """The user writes num_speculative_tokens = depth; vLLM then schedules and verifies all N nodes per request."""
    spec = {**TREE_DRAFTER, "num_speculative_tokens": len(widths), "draft_tree_widths": widths,
            "mamba_state_commit": "reconstruct"}
    config = engine_config(fixture_model, spec).speculative_config
    assert config.num_speculative_tokens == num_nodes
    assert config.draft_tree_depth == len(widths) and config.draft_tree.num_nodes == num_nodes
    rebuilt = pickle.loads(pickle.dumps(config))
    assert rebuilt.num_speculative_tokens == num_nodes and rebuilt.draft_tree_widths == widths


@pytest.mark.parametrize("threshold,schedule", [
    (None, None),
    (0, [(1, 1 << 30, 3)]),  # the chain at every batch size
    (2, [(1, 2, 10), (3, 1 << 30, 3)]),
    ("auto", [(1, 1, 10), (2, 1 << 30, 3)]),  # both counts: vLLM captures both shapes' graphs; the hook chooses
])
def test_tree_threshold_sets_vllms_dynamic_schedule(fixture_model, threshold, schedule):
    """draft_tree_max_batch_size T: batches of <= T requests draft the [2, 2, 1] tree's 10 nodes, larger ones the
    chain of its depth 3, through vLLM's own dynamic speculative decoding schedule; kept by a rebuilt copy."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec = mtp(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1], draft_tree_max_batch_size=threshold)
    engine = engine_config(fixture_model, spec)
    config = engine.speculative_config
    assert config.num_speculative_tokens == 10 and config.num_speculative_tokens_per_batch_size == schedule
    rebuilt = pickle.loads(pickle.dumps(config))
    assert rebuilt.num_speculative_tokens_per_batch_size == schedule
    assert rebuilt.compute_hash() == config.compute_hash()
    if threshold is not None:
        lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=6, vllm_num_speculative_tokens=10)
        assert set(lookup[1:]) == {10, 3} if threshold == "auto" else lookup[1:] == [
            10 if b <= threshold else 3 for b in range(1, 7)]
        other = engine_config(fixture_model, {**spec, "draft_tree_max_batch_size": 1 if threshold == "auto"
                                              else threshold + 1})
        assert other.speculative_config.compute_hash() != config.compute_hash()
