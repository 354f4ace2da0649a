"""The models a grid serves, written locally (no model hub): the project's fixture, or a Qwen3.5 or Qwen3-Next shape
for `--load-format dummy` with a synthetic tokenizer whose vocabulary matches the config's.

No vllm import: these run before any server starts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.sweep.workloads import TextSource

# Qwen3.5-27B's text model (config.json of Qwen/Qwen3.5-27B, text_config): 64 layers, 3 Gated DeltaNet : 1 full
# attention, GDN 16 key heads and 48 value heads of K = V = 128, attention 24 query / 4 KV heads of 256
# (partial rotary 0.25), one MTP layer, fp32 SSM state. Vision tower left out: text-only serving.
QWEN35_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    attn_output_gate=True,
    mtp_num_hidden_layers=1,
    mamba_ssm_dtype="float32",
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
# The same vocabulary and layer pattern at a size a CPU serves in seconds: checks the dummy-weight path
# (config, synthetic tokenizer, synthetic acceptance) before device time is spent on the full shape.
QWEN35_27B_VOCAB_SMALL = dict(
    QWEN35_27B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64,
)  # fmt: skip
# Qwen3.5-35B-A3B's text model (config.json of Qwen/Qwen3.5-35B-A3B, text_config; sources in bench/sweep/README.md,
# "The A3B shape"): 40 layers, 3 Gated DeltaNet : 1 full attention (full_attention_interval 4), hidden 2048, 256
# experts of 512 with 8 routed per token and one shared expert of 512, GDN 16 key / 32 value heads of K = V = 128,
# conv kernel 4, attention 16 query / 2 KV heads of 256 (output gate, partial rotary 0.25), one MTP layer, fp32 SSM
# state. Left out: the vision tower and M-RoPE's sections (text-only serving: with one position per token,
# interleaved M-RoPE rotates as 1D RoPE does).
QWEN35_35B_A3B = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    attn_output_gate=True,
    mtp_num_hidden_layers=1,
    mamba_ssm_dtype="float32",
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
# Qwen3.5-122B-A10B's layer (hidden 3072, 256 experts of 1024, 8 routed + one shared of 1024, GDN 16 key / 64 value
# heads of 128, attention 32 query / 2 KV heads of 256) on 16 of its 48 layers: the same 3 : 1 pattern and per-layer
# sizes, 41.7 B parameters without the MTP layer (~82 GiB of bf16 weights with it), which leaves one H200 room for a
# KV cache. The A3B shape: 34.7 B (~66 GiB with its MTP layer).
QWEN35_122B_A10B_16L = dict(
    QWEN35_35B_A3B, hidden_size=3072, num_hidden_layers=16, num_attention_heads=32, linear_num_value_heads=64,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
)  # fmt: skip
# The A3B grid's model path (MoE config class, word-level tokenizer, dummy weights) at a CPU size.
QWEN35_A3B_VOCAB_SMALL = dict(
    QWEN35_35B_A3B, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128,
)  # fmt: skip
# Qwen3-Next-80B-A3B's model (config.json of Qwen/Qwen3-Next-80B-A3B-Instruct as public copies quote it; transformers'
# Qwen3NextConfig defaults, documented as that checkpoint's, agree but for rope_theta, max_position_embeddings and the
# dense intermediate_size, which no layer uses: mlp_only_layers is empty; sources in bench/sweep/README.md): 48
# layers, 3 Gated DeltaNet : 1 full attention,
# hidden 2048, 512 experts of 512 with 10 routed per token and one shared expert of 512, GDN 16 key / 32 value heads
# of K = V = 128 (the A3B's), projections interleaved by key head (vLLM's gqa_interleaved_layout), attention 16
# query / 2 KV heads of 256 (output gate, partial rotary 0.25), one MTP layer (vLLM's default when the config names
# none). No mamba_ssm_dtype: vLLM keeps its GDN state in the activation dtype (bf16) unless --mamba-ssm-cache-dtype
# says otherwise.
QWEN3_NEXT_80B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    norm_topk_prob=True,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
    partial_rotary_factor=0.25,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
# Its layer on 20 of the 48 (the 3 : 1 pattern and every layer's size kept): 1.65 B parameters a layer (512 experts
# of 3 x 2048 x 512), 33.6 B with the embeddings and the LM head (transformers' model on the meta device), 35.2 B with
# the MTP layer (35.8 B if it keeps its own embeddings and head), 66-67 GiB of bf16 weights: what the Qwen3.5-35B-A3B
# shape takes (34.7 B, ~66 GiB), so the A3B grid's KV budgets fit beside it on one H200. A request's GDN and
# attention state is half the A3B's (15 GDN and 5 attention layers against 30 and 10).
QWEN3_NEXT_80B_A3B_20L = dict(QWEN3_NEXT_80B_A3B, num_hidden_layers=20)
SHAPES = {"qwen35-27b": QWEN35_27B, "qwen35-27b-vocab-small": QWEN35_27B_VOCAB_SMALL, "qwen35-35b-a3b": QWEN35_35B_A3B,
          "qwen35-122b-a10b-16l": QWEN35_122B_A10B_16L, "qwen35-a3b-vocab-small": QWEN35_A3B_VOCAB_SMALL,
          "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B, "qwen3-next-80b-a3b-20l": QWEN3_NEXT_80B_A3B_20L}
QWEN3_NEXT_SHAPES = frozenset({"qwen3-next-80b-a3b", "qwen3-next-80b-a3b-20l"})  # Qwen3NextForCausalLM's
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIXTURE_STREAM_PROMPTS = 64


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    load_format: str  # "auto" (weights on disk) or "dummy"
    text: TextSource
    tokenizer: Path | None = None  # a tokenizer directory apart from the model's (`--tokenizer`); None: the model's


def _tokenizer_text_source(model_dir: Path, token_stream: list[int]) -> TextSource:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return TextSource(token_stream, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def prepare_fixture(out_dir: Path) -> PreparedModel:
    """The project's tiny Qwen3.5 hybrid with its MTP head; prompts are cut from the text its tokenizer learned,
    which is also what its MTP head drafts well."""
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture, fixture_prompts

    path = build_fixture(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stream = [t for prompt in fixture_prompts(tokenizer, FIXTURE_STREAM_PROMPTS) for t in prompt]
    return PreparedModel(path, "auto", _tokenizer_text_source(path, stream))


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly vocab_size tokens ("t0" ... ), so that every id a dummy-weight model
    samples decodes, and a prompt of n words is n tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        chat_template=(
            "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
        ),
    ).save_pretrained(out_dir)


def is_moe(dims: dict) -> bool:
    return "num_experts" in dims


def config_class(shape: str) -> tuple[type, str]:
    """(transformers config class, vLLM architecture) of a shape: Qwen3-Next's (`QWEN3_NEXT_SHAPES`), else Qwen3.5's
    MoE text model for a shape with experts, its dense one without."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    if shape in QWEN3_NEXT_SHAPES:
        return Qwen3NextConfig, "Qwen3NextForCausalLM"
    if is_moe(SHAPES[shape]):
        return Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"
    return Qwen3_5TextConfig, "Qwen3_5ForCausalLM"


def write_shape_config(out_dir: Path, shape: str, num_layers: int | None = None) -> Path:
    """config.json (and shape.json, the dims as written) of a shape, as `config_class` names its model. `num_layers`:
    the shape cut to that many layers (a multiple of 4: the 3 GDN : 1 attention pattern kept), every layer's size
    kept."""
    dims = SHAPES[shape]
    if num_layers is not None:
        if num_layers <= 0 or num_layers % 4:
            raise ValueError(f"num_layers={num_layers}: a multiple of 4 (3 GDN : 1 full attention), e.g. 16")
        dims = dict(dims, num_hidden_layers=num_layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_cls, architecture = config_class(shape)
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    config = config_cls(
        **dims,
        layer_types=layer_types * (dims["num_hidden_layers"] // len(layer_types)),
        eos_token_id=0,
        bos_token_id=0,
        architectures=[architecture],
        dtype="bfloat16",
    )
    config.save_pretrained(out_dir)
    (out_dir / "shape.json").write_text(json.dumps({"shape": shape, **dims}, indent=1) + "\n")
    return out_dir


def prepare_qwen35_shape(out_dir: Path, shape: str, num_layers: int | None = None) -> PreparedModel:
    """config.json of a shape (Qwen3.5's or Qwen3-Next's; weights come from `--load-format dummy`) and a matching
    tokenizer, in a directory of its own (`out_dir/tokenizer`, no config.json): transformers 5 loads the tokenizer of
    a directory whose config says qwen3_5* as its Qwen3.5 BPE class whatever tokenizer_config.json names, which would
    not be the word-level one (its text would decode without spaces). `num_layers`: as `write_shape_config`."""
    dims = SHAPES[shape]
    write_shape_config(out_dir, shape, num_layers)
    tokenizer = out_dir / "tokenizer"
    write_word_tokenizer(tokenizer, dims["vocab_size"])
    rng = random.Random(f"{shape}-prompts")
    stream = [rng.randrange(len(SPECIAL_TOKENS), dims["vocab_size"]) for _ in range(65536)]
    return PreparedModel(out_dir, "dummy", _tokenizer_text_source(tokenizer, stream), tokenizer)


def prepare_model(name: str, out_dir: Path) -> PreparedModel:
    if name == "fixture-tiny":
        return prepare_fixture(out_dir)
    if name in SHAPES:
        return prepare_qwen35_shape(out_dir, name)
    raise ValueError(f"unknown model {name!r}; known: fixture-tiny, {', '.join(SHAPES)}")
