"""The ranks of a tensor-parallel group: how they start, the loop every rank but 0 runs, and how they stop.

On one host the driver (rank 0: the process that built the engine) spawns ranks 1..N-1, one process per GPU.
Across hosts `torchrun` starts every rank with the same command; rank 0 drives (serves, generates) and the other
ranks run the worker loop inside the engine's constructor and exit with it. Each rank loads only its shard and
allocates its own KV cache (its heads); the driver alone schedules, owns the block manager and samples. Each step
the driver broadcasts the step's plan (without its samples) and every rank runs the same forward pass.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import queue
import signal
import socket
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashpage.config import ModelConfig
from flashpage.engine.config import EngineConfig
from flashpage.engine.runner import ModelRunner, default_cpu_threads, resolve_device
from flashpage.parallel.group import TensorParallel, check_heads

log = logging.getLogger("flashpage.parallel")

# A collective that some rank does not join within this long fails, so a hung worker ends the run.
TIMEOUT = datetime.timedelta(minutes=5)
# How long a failed collective waits to see which rank died before it says only that the collective failed.
DEATH_WAIT_S = 2.0
# NVLink multicast (NVLS) stays off, also in the processes started here (they inherit the environment).
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot go on."""


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the numbers unless `size` ranks can share this model."""
    check_heads(config.num_attention_heads, config.num_key_value_heads, size)
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the MLP's intermediate size "
                         f"{config.intermediate_size}")


def _torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE where torchrun started this process, else None."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    return {name: int(os.environ.get(name, "0" if name.startswith(("RANK", "LOCAL_RANK")) else "1")) for name in names}


@dataclasses.dataclass
class Workers:
    """The driver's handle on the other ranks (their processes where it started them; none under torchrun)."""
    tp: TensorParallel
    processes: list
    stopped: bool = False
    # rank 0's runner's release_graphs, held weakly (the exit hook holds these Workers, not the engine's memory)
    release_graphs: weakref.WeakMethod | None = None

    def failure(self, error: BaseException) -> WorkerFailed:
        """The error to raise for a failed collective: which ranks died and how, or what failed."""
        dead = self._dead()
        deadline = time.monotonic() + DEATH_WAIT_S
        while not dead and self.processes and time.monotonic() < deadline:
            time.sleep(0.02)  # a killed rank's sockets close before its exit status can be read
            dead = self._dead()
        if dead:
            what = ", ".join(f"rank {rank} exited with {_exit_status(code)}" for rank, code in dead)
            message = f"tensor-parallel worker failed ({what}); the engine has stopped"
        else:
            message = f"tensor-parallel collective failed: {error}; the engine has stopped"
        self.shutdown(healthy=False)
        return WorkerFailed(message)

    def _dead(self) -> list[tuple[int, int]]:
        return [(rank, p.exitcode) for rank, p in enumerate(self.processes, 1) if not p.is_alive()]

    def shutdown(self, healthy: bool = True) -> None:
        """Stop the other ranks and release the process group. Every rank releases its CUDA graphs first (this one
        here, the others once told to leave their loop): NCCL's teardown on a rank whose graphs lived on hung after
        its peers were killed (H100 and H200 pairs). In health the ranks then leave the group together (NCCL's
        teardown waits for every rank); after a failed collective (`healthy` False) they are not told. Ranks this
        process started that have not exited within 10 s of the teardown (say, stuck in a collective after Ctrl-C
        mid-step) are terminated."""
        if self.stopped:
            return
        self.stopped = True
        if self.release_graphs is not None and (release := self.release_graphs()) is not None:
            release(wait=healthy)  # (after a failure a collective may never finish)
        if healthy:
            try:
                self.tp.broadcast_object(None)
                self.tp.barrier()  # (no rank leaves the group while another still reads the None)
                dist.destroy_process_group()
            except RuntimeError:
                healthy = False  # a rank is gone
        for p in self.processes:
            p.join(timeout=10 if healthy else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if not healthy and dist.is_initialized():
            dist.destroy_process_group()


def _exit_status(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def is_worker_rank() -> bool:
    """Whether torchrun started this process as a rank other than 0 (one that runs the worker loop only)."""
    env = _torchrun_env()
    return env is not None and env["RANK"] != 0


def start_workers(cfg: EngineConfig, config: ModelConfig) -> tuple[EngineConfig, Workers]:
    """Make this process rank 0 of cfg.tensor_parallel_size ranks of `config`'s model, starting the others (or
    joining torchrun's). Returns rank 0's engine settings (its device and threads) and the workers' handle. Under
    torchrun, on any other rank this runs the worker loop and then exits the process."""
    size = cfg.tensor_parallel_size
    check_tensor_parallel(config, size)
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process; shut it down first "
                         "(LLM.shutdown())")
    env = _torchrun_env()
    if env is not None and env["WORLD_SIZE"] != size:
        raise ValueError(f"torchrun started {env['WORLD_SIZE']} ranks (WORLD_SIZE) but tensor_parallel_size={size}; "
                         f"they must be equal (for example --nnodes 2 --nproc-per-node {max(1, size // 2)})")
    local_size = env["LOCAL_WORLD_SIZE"] if env else size
    cuda = resolve_device(cfg.device).startswith("cuda")
    if cuda and local_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {local_size} GPUs on this host, which has "
                         f"{torch.cuda.device_count()}")

    def rank_cfg(local_rank: int) -> EngineConfig:
        threads = cfg.cpu_threads or max(1, default_cpu_threads() // local_size)  # the cores shared by the ranks
        return dataclasses.replace(cfg, device=f"cuda:{local_rank}" if cuda else "cpu", cpu_threads=threads)

    if env is not None:
        tp = _join(env["RANK"], size, "env://", env["LOCAL_RANK"] if cuda else None)
        if tp.rank != 0:
            try:
                run_worker(rank_cfg(env["LOCAL_RANK"]), tp)
            finally:
                dist.destroy_process_group()
            raise SystemExit(0)
        return rank_cfg(env["LOCAL_RANK"]), _stop_at_exit(Workers(tp, []))
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    started = ctx.Queue()
    processes = [ctx.Process(target=_worker_main, args=(rank_cfg(rank), rank, size, init, cuda, started),
                             daemon=True, name=f"flashpage-tp{rank}") for rank in range(1, size)]
    for p in processes:
        p.start()
    _wait_started(processes, started)
    return rank_cfg(0), _stop_at_exit(Workers(_join(0, size, init, 0 if cuda else None), processes))


def _wait_started(processes: list, started) -> None:
    """Wait until every spawned rank is about to join the group; one that dies first is an error here (joining
    the group would wait for it until the timeout)."""
    waiting = set(range(1, len(processes) + 1))
    while waiting:
        try:
            waiting.discard(started.get(timeout=0.2))
        except queue.Empty:
            dead = [(rank, p.exitcode) for rank, p in enumerate(processes, 1) if rank in waiting and not p.is_alive()]
            if dead:
                for p in processes:
                    p.kill()
                what = ", ".join(f"rank {rank} exited with {_exit_status(code)}" for rank, code in dead)
                raise WorkerFailed(f"tensor-parallel worker failed to start ({what}; its error is printed above). A "
                                   f"script that starts tensor-parallel ranks must create the LLM under "
                                   f"`if __name__ == \"__main__\":`, as the ranks import it again")


def _stop_at_exit(workers: Workers) -> Workers:
    atexit.register(workers.shutdown)
    return workers


def _join(rank: int, size: int, init_method: str, cuda_device: int | None) -> TensorParallel:
    """Join the group: NCCL for device tensors on CUDA (plus a gloo group for the plans), gloo on CPU."""
    if cuda_device is not None:
        for name, value in _NCCL_ENV.items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(cuda_device)
    dist.init_process_group("nccl" if cuda_device is not None else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda_device is not None else dist.group.WORLD
    return TensorParallel(rank, size, dist.group.WORLD, cpu_group)


def run_worker(cfg: EngineConfig, tp: TensorParallel) -> None:
    """A rank other than 0: load the shard, then run each step's forward pass until the driver says stop."""
    runner = ModelRunner(cfg, tp=tp)
    while (plan := tp.broadcast_object()) is not None:
        runner.forward(plan)
    runner.release_graphs()
    tp.barrier()


def _worker_main(cfg: EngineConfig, rank: int, size: int, init_method: str, cuda: bool, started) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; the driver stops the workers
    started.put(rank)
    tp = _join(rank, size, init_method, int(cfg.device.partition(":")[2]) if cuda else None)
    try:
        run_worker(cfg, tp)
    except RuntimeError as e:  # the driver (or another rank) is gone
        log.error("tensor-parallel rank %d stops: %s", rank, e)
        _exit(1)
    dist.destroy_process_group()
    _exit(0)


def _exit(code: int) -> None:
    """End a worker rank without the interpreter's teardown, as a forked multiprocessing child ends: a spawned
    one runs it, and there C++ objects of the process group left behind by `destroy_process_group` were destroyed
    with a thread still joinable about once in 50 CPU (gloo) runs, `std::terminate` turning exit 0 into SIGABRT
    after the rank's work was done. Its output is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
