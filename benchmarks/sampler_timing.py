"""Time one draw per row from a softmax over the SmolLM2 vocabulary: torch.multinomial against the inverse-CDF
sampler the drafters and the engine use (``generation.decoding.drafting.sample_categorical``).

    python benchmarks/sampler_timing.py
"""

import time

import torch

from generation.decoding.drafting import sample_categorical


def per_call_ms(fn, n: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - start) / n


if __name__ == "__main__":
    torch.manual_seed(0)
    for rows in (1, 16):
        probs = (torch.randn(rows, 49152) * 3).softmax(-1)
        times = {"multinomial": [], "inverse": []}
        for _ in range(3):  # alternate, keep the best of each: the machine's other load hits both alike
            times["multinomial"].append(per_call_ms(lambda: torch.multinomial(probs, 1)))
            times["inverse"].append(per_call_ms(lambda: sample_categorical(probs)))
        multinomial, inverse_cdf = min(times["multinomial"]), min(times["inverse"])
        print(f"{rows:>2} rows: torch.multinomial {multinomial:.2f} ms, inverse CDF {inverse_cdf:.2f} ms")
