"""Conveniences for data-parallel torch scripts: data shards, metric averaging, LR warm-up, rank-0 output."""
from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Sized, Iterator, Optional, TypeVar, Union

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from dualframe.errors import StrategyError
from dualframe.pipeline.microbatch import micro_batch_offsets
from dualframe.dp.scaling import warmup_factor
from dualframe.torch.collectives import check_initialized, hvd

T = TypeVar("T")


def shard_batch(batch: torch.Tensor) -> torch.Tensor:
    """This rank's consecutive rows of a global batch (sizes differ by at most one row).

    Example:
        >>> x_local = hvd.shard_batch(x_global)   # rank r of n gets rows [r*len/n, (r+1)*len/n)  # doctest: +SKIP
    """
    check_initialized("shard_batch()")
    rows = micro_batch_offsets(int(batch.shape[0]), hvd.size())[hvd.rank()]
    return batch[rows.start:rows.stop]


def distributed_sampler(dataset: Dataset, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False) -> DistributedSampler:
    """A ``DistributedSampler`` giving this rank its shard of ``dataset``; call ``set_epoch`` each epoch.

    Example:
        >>> sampler = hvd.distributed_sampler(train_set)                           # doctest: +SKIP
        >>> loader = DataLoader(train_set, batch_size=32, sampler=sampler)         # doctest: +SKIP
    """
    check_initialized("distributed_sampler()")
    return DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def metric_average(value: Union[float, torch.Tensor], name: Optional[str] = None) -> float:
    """The average over ranks of a scalar metric (loss, accuracy ...); every rank must call it."""
    check_initialized("metric_average()")
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
    return float(hvd.allreduce(tensor, op=hvd.Average, name=name or "dualframe.metric_average"))


def warmup_lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int,
                        world_size: Optional[int] = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Scale the optimizer's learning rates by the world size, reached linearly over ``warmup_steps``.

    Give the optimizer the one-process learning rate and call ``scheduler.step()`` after each
    ``optimizer.step()``.

    Example:
        >>> scheduler = hvd.warmup_lr_scheduler(optimizer, warmup_steps=100)   # doctest: +SKIP
    """
    size = world_size if world_size is not None else (hvd.size() if hvd.is_initialized() else None)
    if size is None:
        raise StrategyError("warmup_lr_scheduler needs hvd.init() first or an explicit world_size")
    warmup_factor(0, warmup_steps, size)  # validates before the scheduler touches the optimizer
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps, size))


def is_root() -> bool:
    """True on rank 0 (and in a process that has not called ``init``)."""
    return not hvd.is_initialized() or hvd.rank() == 0


def log(*values: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed, so launchers show it at once)."""
    if is_root():
        print(*values, flush=True, **kwargs)


def progress(iterable: Iterable[T], total: Optional[int] = None, desc: str = "") -> Iterator[T]:
    """Iterate, drawing a progress bar on rank 0 only (tqdm when installed, else a plain one on stderr)."""
    if not is_root():
        yield from iterable
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from _plain_progress(iterable, total, desc)
        return
    yield from tqdm(iterable, total=total, desc=desc)


def _plain_progress(iterable: Iterable[T], total: Optional[int], desc: str) -> Iterator[T]:
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    start, done, shown, width = time.perf_counter(), 0, -1, 30
    for item in iterable:
        yield item
        done += 1
        tenth = 10 * done // total if total else done // 100
        if tenth == shown:
            continue  # redraw in tenths only: launchers turn every write into a line
        shown = tenth
        elapsed = time.perf_counter() - start
        if total:
            bar = "#" * (width * done // total) + "." * (width - width * done // total)
            sys.stderr.write(f"\r{desc} [{bar}] {done}/{total} {elapsed:.1f}s")
        else:
            sys.stderr.write(f"\r{desc} {done} {elapsed:.1f}s")
        sys.stderr.flush()
    sys.stderr.write("\n")
