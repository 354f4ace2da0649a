"""A soak of `vllm serve` with reconstruct chains and MTP trees: a seeded mix of accepted, refused, dropped and aborted
requests through the `openai` client, then checks that the server kept serving and leaked nothing
(`python3 -m bench.soak --help`)."""
