"""Serving sweeps (issue 11): strategy x memory budget x workload x concurrency/arrival rate, run through vLLM's
own `vllm bench sweep serve`, with what it lacks added (local workloads, server-side scheduler figures, the
reconstruct / store_all report). See bench/sweep/README.md."""
