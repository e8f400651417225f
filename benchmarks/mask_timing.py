"""Time the target's forward of W new tokens on R rows of cache, given the 2-D all-ones mask (which Transformers
drops, so torch's sdpa runs with ``enable_gqa`` and no mask) against the same mask ready-made in 4-D
(``generation.serving.ragged_cache.verify_attention_mask``), which the engine passes on CPU.

    python benchmarks/mask_timing.py
"""

import statistics
import time

import torch
from transformers.cache_utils import DynamicCache

from generation.serving.ragged_cache import verify_attention_mask
from modeling_dspark.targets import dtype_label, load_target

if __name__ == "__main__":
    target, _ = load_target()
    vocab, context = target.config.vocab_size, 256
    g = torch.Generator().manual_seed(0)
    print(f"SmolLM2-135M-Instruct, {dtype_label(target.dtype)}, {context} cached tokens per row, median of 6 forwards")
    for rows in (1, 8, 16):
        cache = DynamicCache()
        with torch.no_grad():
            target(input_ids=torch.randint(1, vocab, (rows, context), generator=g), cache=cache, use_cache=True)
        for width in (1, 2, 8):
            ids = torch.randint(1, vocab, (rows, width), generator=g)
            positions = torch.arange(context, context + width)[None].expand(rows, -1)
            cache_valid, new_valid = torch.ones(rows, context, dtype=torch.bool), torch.ones(rows, width, dtype=torch.bool)
            masks = {"2-D": verify_attention_mask(cache_valid, new_valid), "4-D": verify_attention_mask(cache_valid, new_valid, four_d=True)}
            times = {label: [] for label in masks}
            for i in range(8):  # alternate the two, the first two passes untimed
                for label, mask in masks.items():
                    start = time.perf_counter()
                    with torch.no_grad():
                        target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
                    if i >= 2:
                        times[label].append(time.perf_counter() - start)
                    cache.crop(-width)
            two, four = (1000 * statistics.median(times[k]) for k in ("2-D", "4-D"))
            print(f"R={rows:>2} W={width}: 2-D mask {two:6.1f} ms, 4-D mask {four:6.1f} ms ({two / four:.2f}x)")
