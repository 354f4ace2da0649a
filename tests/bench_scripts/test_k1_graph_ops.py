"""bench/host/k1_graph_ops.py counts what a reconstruct chain's decode step runs in its GDN forwards on the CUDA path:
per GDN group one count update, per layer the step's three kernels, and no parents derived for chains."""

from bench.host.k1_graph_ops import count


def test_a_chain_step_runs_the_count_updates_and_the_step_kernels_only():
    counts, parents_given = count(batch=4, k=1, layers_per_group=[2, 1])
    assert parents_given == {False}
    assert dict(counts) == {"TRITON LAUNCH _commit_nodes_kernel": 2, "TRITON LAUNCH conv step": 3,
                            "TRITON LAUNCH gated step (state pass + epilogue)": 6}
