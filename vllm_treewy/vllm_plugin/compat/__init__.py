"""Start-up fixes: vLLM's CPU wheel's rejection-sampling kernel (`cpu_rejection_expand`) and the start-up memory
profile (`startup_memory`)."""
