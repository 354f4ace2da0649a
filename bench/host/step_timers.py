"""Host seconds and calls of wrapped methods per engine step, and the CUDA-graph mode vLLM dispatched each step to:
the timers that `gpu_host_audit` (the whole step) and `phase_timing` (the draft-tree path's phases) install in an
engine's process. Its own module so that both import it and neither imports the other."""

import collections
import functools
import time


class StepTimers:
    """Host seconds and calls of wrapped methods, by label, and the CUDA graph mode of each step."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.cudagraph_modes = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> bool:
        """`owner.name` timed (an instance attribute over a bound method, or a replaced class or module attribute);
        False if `owner` has no such attribute."""
        method = getattr(owner, name, None)
        if method is None:
            return False

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)
        return True

    def record_cudagraph_modes(self, runner) -> None:
        """Each step's CUDA graph mode and padded token count, as the V1 runner's dispatch returns them (V2 has no
        such method: nothing recorded)."""
        determine = getattr(runner, "_determine_batch_execution_and_padding", None)
        if determine is None:
            return

        @functools.wraps(determine)
        def recorded(*args, **kwargs):
            result = determine(*args, **kwargs)
            mode, descriptor = result[0], result[1]
            self.cudagraph_modes[f"{getattr(mode, 'name', mode)} tokens={getattr(descriptor, 'num_tokens', '?')}"] += 1
            return result

        runner._determine_batch_execution_and_padding = recorded

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.cudagraph_modes.clear()

    def per_step(self, steps: int) -> dict:
        return {label: {"calls_per_step": self.calls[label] / steps, "us_per_step": 1e6 * s / steps}
                for label, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
