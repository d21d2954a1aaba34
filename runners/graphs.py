"""CUDA-graph runner: the engine's forward captured once per shape bucket and variant, then replayed.

A batch of B rows padded to length L runs in the smallest bucket (rows, length) that holds it: rows rounded up
to one of two steps per octave (1, 2, 3, 4, 6, 8, 12, ...), length to one of four steps per octave (at most 25%
padding past 64 tokens). Where a run's batches are known before it starts (compare), `BucketPlan.fit` merges those
rounded buckets while the padding a merge adds costs less than the capture it saves. Each bucket has
static buffers — input ids [rows, length], adapter slot per token [rows * length] — and up to two captured
graphs: the forward with the LoRA kernels recorded, and the plain forward (a batch with no adapter row
replays that one and pays nothing for LoRA). Padding rows hold token 0 and no adapter; right padding never
changes a real position (causal attention), and a replay equals the eager forward of the same padded batch.

Graphs are captured lazily, the first time a bucket is needed, into one shared memory pool (replays run one at
a time, and each output is consumed before the next replay). Capture stops, and batches run eagerly, past
`max_buckets` captured graphs, past `max_memory` bytes of pool, or beyond the largest bucket
(`max_tokens`). `stats()` reports what was captured, the pool's size, how many batches replayed and the seconds
the warm-ups and captures took (a run's compile phase).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations

import torch

from .compile_clock import COMPILE_CLOCK

MIN_LENGTH = 16
# A capture (its warm-up and recording, the kernels' first loads for the shape) costs about as much as the forward of
# this many tokens; 30,000 pads a third less than 50,000 for the same capture + forward: BENCHMARKS-history 12 and 13
# (BENCHMARKS.md "graph buckets fitted at 30,000 tokens"; the figures: 18.3)
CAPTURE_TOKENS = 30_000


def round_length(n: int) -> int:
    """The bucket length for n tokens: a multiple of a quarter of the octave below n (>= MIN_LENGTH)."""
    if n <= MIN_LENGTH:
        return MIN_LENGTH
    step = max(1 << ((n - 1).bit_length() - 3), 1)  # 2^(floor(log2(n-1)) - 2): four steps per octave
    return -(-n // step) * step


def round_rows(n: int) -> int:
    """The bucket row count for n rows: the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two steps per octave)."""
    if n <= 4:
        return max(n, 1)
    high = 1 << (n - 1).bit_length()  # the power of two >= n
    return high * 3 // 4 if n <= high * 3 // 4 else high


def pad_to_bucket(ids: torch.Tensor, slots: list[int], rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] -> ids [rows, length] (token 0 after each row and in the extra rows) and the adapter slot of
    every token [rows * length] (-1 in the extra rows)."""
    B, L = ids.shape
    padded = torch.zeros(rows, length, dtype=torch.long)  # [rows, length]
    padded[:B, :L] = ids
    row_slots = torch.full((rows,), -1, dtype=torch.long)  # [rows]
    row_slots[:B] = torch.tensor(slots, dtype=torch.long)
    return padded, row_slots.repeat_interleave(length)  # [rows, length], [rows * length]


@dataclass
class BucketPlan:
    """Which bucket a batch runs in, and whether a new graph may still be captured (no CUDA needed)."""
    max_tokens: int = 16384  # the largest bucket, rows * length
    max_buckets: int = 32  # captured graphs (each variant counts)
    max_memory: int | None = None  # bytes of graph pool; None: no limit
    capture_tokens: int = CAPTURE_TOKENS  # what a capture costs, in tokens of forward (fit)
    captured: dict = field(default_factory=dict)  # (rows, length, lora) -> pool bytes after its capture
    fitted: dict = field(default_factory=dict)  # lora -> the buckets fit() chose for a known run's batches

    def bucket(self, rows: int, length: int, lora: bool = False) -> tuple[int, int] | None:
        """(rows, length) of the bucket for a batch (the smallest fitted one that holds it, else the rounded shape),
        or None when it is beyond the largest (run eagerly)."""
        holding = [s for s in self.fitted.get(lora, ()) if s[0] >= rows and s[1] >= length]
        shape = min(holding, key=lambda s: (s[0] * s[1], s)) if holding else (round_rows(rows), round_length(length))
        return shape if shape[0] * shape[1] <= self.max_tokens else None

    def fit(self, shapes: list[tuple[int, int, bool]]) -> None:
        """Buckets for a run whose batches are known: `shapes` holds each batch's (rows, length, with an adapter
        row). Per variant, start from the batches' rounded buckets, then merge the two whose union (the larger rows
        and the larger length) adds the least padding over their batches, while that is under `capture_tokens` and
        the union within `max_tokens`: each merge saves a capture for less than its cost in forward."""
        self.fitted = {}
        for lora in (False, True):
            count = Counter(s for s in ((round_rows(r), round_length(n)) for r, n, v in shapes if v == lora)
                            if s[0] * s[1] <= self.max_tokens)  # bucket -> batches in it
            while len(count) > 1:
                best = None
                for a, b in combinations(count, 2):
                    union = max(a[0], b[0]), max(a[1], b[1])
                    area = union[0] * union[1]
                    extra = count[a] * (area - a[0] * a[1]) + count[b] * (area - b[0] * b[1])  # padded tokens
                    if area <= self.max_tokens and (best is None or extra < best[0]):
                        best = extra, a, b, union
                if best is None or best[0] >= self.capture_tokens:
                    break
                _, a, b, union = best
                merged = count.pop(a) + count.pop(b)
                count[union] += merged  # (union may be a or b, or a third bucket already there)
            self.fitted[lora] = sorted(count)

    def may_capture(self, pool_bytes: int) -> bool:
        """Another capture is allowed: under the graph count, and the pool so far under the memory limit."""
        if len(self.captured) >= self.max_buckets:
            return False
        return self.max_memory is None or pool_bytes < self.max_memory


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [rows, length] static input
    token_slots: torch.Tensor  # [rows * length] static input
    hidden: torch.Tensor  # [rows * length, H] static output
    routes: list | None  # static outputs: (layer, expert ids [rows * length, k], weights) per MoE layer, if recorded


class GraphRunner:
    """`replay(ids, slots)` -> (hidden states [rows * length, H] of the padded batch, the length it was padded
    to, the routes it recorded or None), or None when the batch must run eagerly; `ids` [B, L] on the CPU, `slots`
    one adapter slot per row (-1: none). `build(ids, token_slots, lora, routes=list)` returns the hidden states of a
    forward over device tensors (appending each MoE layer's routing to the list: Forward's `routes`); it is what
    gets captured. With `record_routes` set, graphs captured from then on keep their routing as further static
    outputs (memory: ids and weights of each MoE layer), and only they replay a batch that asks for routes. The
    outputs live in static buffers: use them before the next replay."""

    def __init__(self, build, device: torch.device, plan: BucketPlan | None = None):
        self.build = build
        self.device = device
        self.plan = plan or BucketPlan()
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.pool_bytes = 0
        self.replays = 0
        self.eager = 0
        self.capture_s = 0.0  # seconds of warm-up (Triton compiles) and capture, device work included
        self.record_routes = False

    def replay(self, ids: torch.Tensor, slots: list[int], routes: bool = False) -> tuple | None:
        B, L = ids.shape
        lora = max(slots) >= 0
        shape = self.plan.bucket(B, L, lora)
        key = (*shape, lora) if shape else None
        if key is not None and key not in self.graphs and self.plan.may_capture(self.pool_bytes):
            self.graphs[key] = self._capture(*key)
        if key is None or key not in self.graphs or (routes and self.graphs[key].routes is None):
            self.eager += 1
            return None
        g = self.graphs[key]
        padded, token_slots = pad_to_bucket(ids, slots, *shape)
        g.ids.copy_(padded.pin_memory(), non_blocking=True)  # pinned: the copies do not wait for the host
        g.token_slots.copy_(token_slots.pin_memory(), non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.hidden, shape[1], g.routes

    def _capture(self, rows: int, length: int, lora: bool) -> _Graph:
        with COMPILE_CLOCK.paused():  # its compiles are in capture_s
            return self._capture_timed(rows, length, lora)

    def _capture_timed(self, rows: int, length: int, lora: bool) -> _Graph:
        t0 = time.perf_counter()
        ids = torch.zeros(rows, length, dtype=torch.long, device=self.device)  # [rows, length]
        token_slots = torch.full((rows * length,), 0 if lora else -1, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, library workspaces
            self.build(ids, token_slots, lora)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside a capture: collecting an engine that is no longer referenced destroys its
        # graphs, and destroying a graph while another is being captured invalidates that capture (e.g. an
        # engine built per case in one process, the earlier ones dropped). torch's graph context no longer collects
        # on entry, so collect here, then hold collection off until the capture ends.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            # Captured on `side`, a stream of the engine's GPU: torch's default capture stream is made once, on
            # whichever GPU was current then, and entering a stream context makes its GPU current (else an engine
            # on cuda:1 after one on cuda:0 captures an empty graph: BENCHMARKS-history 11, "An engine on the second
            # GPU").
            with torch.cuda.graph(graph, pool=self.pool, stream=side):  # entering empties the allocator's cache
                before = torch.cuda.memory_reserved(self.device)  # so measure inside
                routes = [] if self.record_routes else None
                hidden = self.build(ids, token_slots, lora, routes=routes)  # [rows * length, H]
        finally:
            if collecting:
                gc.enable()
        self.pool_bytes += max(torch.cuda.memory_reserved(self.device) - before, 0)
        self.plan.captured[(rows, length, lora)] = self.pool_bytes
        torch.cuda.synchronize(self.device)  # the warm-up's kernels done: their time is the capture's
        self.capture_s += time.perf_counter() - t0
        return _Graph(graph, ids, token_slots, hidden, routes)

    def stats(self) -> dict:
        return dict(graphs=len(self.graphs), buckets=sorted({k[:2] for k in self.graphs}),
                    graph_memory_bytes=self.pool_bytes, replays=self.replays, eager_batches=self.eager,
                    capture_s=round(self.capture_s, 3))
