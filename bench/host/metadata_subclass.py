"""CPU time per call of the ways to make `ReconstructGDNAttentionMetadata` (`gdn.step_metadata`) out of vLLM's GDN
metadata, which each GDN group's metadata build does once per engine step: the dataclass `__init__` over every field,
`dataclasses.replace`, `copy.copy` with the class swapped, and `object.__new__` with the instance dictionary filled
(`step_metadata.reconstruct_metadata`, the adapter's). Each: the fastest of `--rounds` rounds of `--calls` calls,
`time.thread_time`.

    python -m bench.host.metadata_subclass
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import timeit


def ways(metadata, ours) -> dict:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_treewy.vllm_plugin.gdn.step_metadata import ReconstructGDNAttentionMetadata, reconstruct_metadata

    fields = tuple(f.name for f in dataclasses.fields(GDNAttentionMetadata))
    defaults = {f.name: f.default for f in dataclasses.fields(ReconstructGDNAttentionMetadata) if f.name not in fields}

    def copy_and_swap_class():
        result = copy.copy(metadata)
        result.__class__ = ReconstructGDNAttentionMetadata
        result.__dict__.update(defaults)
        return result

    return {
        "dataclass __init__ over the fields (a dict of getattr)":
            lambda: ReconstructGDNAttentionMetadata(**{name: getattr(metadata, name) for name in fields}),
        "dataclasses.replace of an instance of ours": lambda: dataclasses.replace(ours),
        "copy.copy, class swapped, defaults set": copy_and_swap_class,
        "object.__new__, dict merge (reconstruct_metadata)": lambda: reconstruct_metadata(metadata),
        "the same from an instance of ours (V2's re-gathered group)": lambda: reconstruct_metadata(ours),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    import vllm_treewy.vllm_plugin as plugin

    plugin.register()  # imports vLLM in the order its modules expect
    import torch
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_treewy.vllm_plugin.gdn.step_metadata import reconstruct_metadata

    rows = torch.zeros(8, dtype=torch.int32)
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=8,
        num_spec_decode_tokens=16, num_actual_tokens=16, spec_query_start_loc=rows, spec_state_indices_tensor=rows,
        spec_sequence_masks=rows, num_accepted_tokens=rows)
    ours = reconstruct_metadata(metadata)
    print(f"{'way':<62}{'us per call':>12}")
    for name, make in ways(metadata, ours).items():
        rounds = timeit.Timer(make, timer=time.thread_time).repeat(number=args.calls, repeat=args.rounds)
        print(f"{name:<62}{1e6 * min(rounds) / args.calls:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
