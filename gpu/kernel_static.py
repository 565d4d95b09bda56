"""Static proxies for the CUDA kernels' speed, measured without a GPU: `servesim bench kernel --static`.

For every template instantiation the CuPy backend compiles, nvcc (`-cubin --resource-usage`)
reports registers, spills and static shared memory; occupancy on an sm_90 SM follows from those
(65536 registers, 64 warps, 228 KiB of shared memory, registers allocated per warp in units of
256). `cuobjdump -sass` gives the machine code, in which the main loop is the backward branch
whose body holds the most 128-bit global loads (the K/V vectors; nested loops are all fully
unrolled in these kernels). "Instructions per 16 bytes" is that body's instruction count over
its 128-bit loads: how many instructions a warp issues per 16 bytes of K/V it moves per lane,
the cost a memory-bound kernel must keep low enough to keep loads in flight.

`compare(before, after)` runs both sides, e.g. main's kernels (a git ref, unpacked with `git
archive`) and the working tree's. Needs nvcc and cuobjdump (plus nvdisasm): on PATH, or from
the pip packages nvidia-cuda-nvcc / nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ARCH = "sm_90"
# sm_90 per-SM limits used for occupancy.
_REGS_PER_SM = 65536
_MAX_WARPS = 64
_MAX_BLOCKS = 32
_SMEM_PER_SM = 228 * 1024
_SMEM_PER_BLOCK_RESERVED = 1024
_REG_UNIT = 256  # registers are allocated per warp in units of 256


class ToolMissing(RuntimeError):
    """nvcc, cuobjdump or nvdisasm cannot be found."""


def find_tool(name: str) -> str:
    """Returns the path of a CUDA tool: PATH first, then the nvidia-* pip packages' bin folders.

    Raises:
        ToolMissing: not found.
    """
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # (lazy: optional, the CUDA tools' pip wheels)

        for root in nvidia.__path__:
            for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
                return str(candidate)
    except ImportError:
        pass
    raise ToolMissing(f"{name} not found: put it on PATH or pip install nvidia-cuda-{name}")


def load_backend_at(ref: str, repo: Path, workdir: Path):
    """Imports `gpu.cupy_backend` as it was at git `ref` (unpacked under `workdir`), or the
    working tree's when ref is "." . Returns the module."""
    if ref == ".":
        from . import cupy_backend  # (lazy: the working tree's kernels, only when asked for)

        return cupy_backend
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        raise RuntimeError(f"--before {ref}: not a commit of the repository at {repo}")
    data = subprocess.run(["git", "-C", str(repo), "archive", ref, "gpu"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(workdir, filter="data")
    name = f"servesim_gpu_at_{re.sub(r'[^0-9A-Za-z]', '_', ref)}"
    spec = importlib.util.spec_from_file_location(name, workdir / "gpu" / "__init__.py",
                                                  submodule_search_locations=[str(workdir / "gpu")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.cupy_backend")


def instantiations(backend, block_sizes=(16,)) -> list[str]:
    """Every kernel template instantiation the backend module compiles (its name expressions),
    for the given block sizes where the kernels take the block size as a template argument."""
    names = []
    keys = backend.module_keys(block_sizes) if hasattr(backend, "module_keys") else _old_module_keys(backend)
    for key in keys:
        names += backend.write_kv_name_expressions() if key[0] == "write_kv" else backend.name_expressions(*key)
    return list(dict.fromkeys(names))


def _old_module_keys(backend):
    keys = [("write_kv", 0)]
    for storage_name in ("float32", "float16", "bfloat16"):
        keys += [(storage_name, head_dim) for head_dim in backend.HEAD_DIMS]
    return keys


def _demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out))


def _short(demangled: str) -> str:
    # "void paged_decode_kernel<F16, 128, 8>(F16::raw const*, ...)" -> "paged_decode_kernel<F16, 128, 8>"
    text = demangled.removeprefix("void ")
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return text[:i]
    return text


def occupancy(registers: int, threads: int, smem: int) -> float:
    """Fraction of an sm_90 SM's 64 warps that blocks of this kernel can keep resident."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // _REG_UNIT) * _REG_UNIT
    by_regs = _REGS_PER_SM // (regs_per_warp * warps)
    by_warps = _MAX_WARPS // warps
    by_smem = _SMEM_PER_SM // (smem + _SMEM_PER_BLOCK_RESERVED) if smem else _MAX_BLOCKS
    blocks = min(by_regs, by_warps, by_smem, _MAX_BLOCKS)
    return blocks * warps / _MAX_WARPS


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LOAD128 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.128\b|\bLDGSTS\.E(?:\.[A-Z0-9_]+)*\.128\b")
# 8-byte K/V loads (the tensor-core kernel's V rows at head_dim 32) count as half a 16-byte one.
_LOAD64 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.64\b|\bLDGSTS\.E(?:\.[A-Z0-9_]+)*\.64\b")


def main_loop(sass_lines: list[str]) -> dict | None:
    """The main loop of one function's SASS: instructions, 128- and 64-bit global loads,
    instructions per 16 bytes they load (a 64-bit load is half a 16-byte unit), and local-memory
    (spill) instructions.

    Returns None when no loop holds such a load.
    """
    instrs = []
    for line in sass_lines:
        m = _INSTR.search(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for index, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [t for a, t in instrs if target <= a <= addr]
        loads = sum(1 for t in body if _LOAD128.search(t))
        loads_64 = sum(1 for t in body if _LOAD64.search(t))
        units = loads + loads_64 / 2  # 16-byte units of K/V loaded per lane
        local = sum(1 for t in body if re.search(r"\b(LDL|STL)\b", t))  # spilled registers
        if units and (best is None or units > best["units_16B"]
                      or (units == best["units_16B"] and len(body) < best["instructions"])):
            best = {"instructions": len(body), "loads_128": loads, "loads_64": loads_64, "units_16B": units,
                    "local_memory": local, "start": hex(target), "end": hex(addr)}
    if best:
        best["instructions_per_16B"] = best["instructions"] / best["units_16B"]
    return best


def analyse(backend, names: list[str], workdir: Path, threads_of) -> list[dict]:
    """Compiles `names` from `backend.kernel_source()` for sm_90 and returns one row per kernel:
    name, registers, spill bytes, shared memory, occupancy and the main-loop figures.

    Raises:
        ToolMissing: no nvcc / cuobjdump.
        RuntimeError: nvcc failed (its log in the message).
    """
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    find_tool("nvdisasm")  # cuobjdump -sass runs it
    source = workdir / "kernels.cu"
    instances = ",\n".join(f"(void*)&{n}" for n in names)
    source.write_text(backend.kernel_source() + f"\nvoid* servesim_instances[] = {{\n{instances}\n}};\n")
    cubin = workdir / "kernels.cubin"
    built = subprocess.run([nvcc, "-cubin", f"-arch={ARCH}", "--resource-usage", str(source), "-o", str(cubin)],
                           capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"nvcc failed: {built.stderr[-3000:]}")
    usage: dict[str, dict] = {}
    current = None
    for line in (built.stdout + built.stderr).splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = usage.setdefault(m.group(1), {})
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["spill_bytes"] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = usage.setdefault(m.group(1), {})
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and current is not None:
            current["registers"], current["smem"] = int(m.group(1)), int(m.group(2))
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(cuobjdump).parent), os.environ.get("PATH", "")]))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env, check=True).stdout
    functions: dict[str, list[str]] = {}
    current_lines: list[str] | None = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current_lines = functions.setdefault(m.group(1), [])
        elif current_lines is not None:
            current_lines.append(line)
    readable = _demangle(list(usage))
    wanted = set(names)
    rows = []
    for mangled, info in usage.items():
        name = _short(readable[mangled])
        if name not in wanted or "registers" not in info:
            continue
        threads = threads_of(name)
        row = {"kernel": name, "registers": info["registers"], "spill_bytes": info.get("spill_bytes", 0),
               "smem": info["smem"], "threads": threads,
               "occupancy": occupancy(info["registers"], threads, info["smem"])}
        loop = main_loop(functions.get(mangled, []))
        if loop:
            row.update(loop_instructions=loop["instructions"], loop_loads_128=loop["loads_128"],
                       loop_local_memory=loop["local_memory"], instructions_per_16B=loop["instructions_per_16B"])
        rows.append(row)
    return sorted(rows, key=lambda r: names.index(r["kernel"]))


def _threads_for(backend):
    def threads_of(name: str) -> int:
        if name.startswith("paged_decode_reduce"):
            return 128
        if name.startswith("paged_decode"):
            return backend.DECODE_THREADS
        if name.startswith("paged_prefill"):
            return backend.PREFILL_THREADS
        return 256
    return threads_of


def side(ref: str, repo: Path, decode_only: bool = False, block_sizes=(16,)) -> list[dict]:
    """analyse() for the kernels at git `ref` ("." = the working tree)."""
    with tempfile.TemporaryDirectory(prefix="servesim-static-") as tmp:
        backend = load_backend_at(ref, repo, Path(tmp))
        names = instantiations(backend, block_sizes)
        if decode_only:
            names = [n for n in names if _is_decode(n)]
        return analyse(backend, names, Path(tmp), _threads_for(backend))


def _is_decode(name: str) -> bool:
    """A decode main kernel (CUDA-core or tensor-core), not the split-K reduce."""
    return name.startswith(("paged_decode_kernel<", "paged_decode_mma_kernel<"))


def decode_shape(name: str) -> tuple:
    """(storage tag, head_dim, heads per block) of a decode instantiation's name, for pairing."""
    args = [a.strip() for a in name[name.index("<") + 1:name.rindex(">")].split(",")]
    return args[0], int(args[1]), int(args[2])


def compare(before: str, after: str, repo: Path, block_sizes=(16,)) -> dict:
    """Both sides' rows and, per decode (storage, head_dim, heads per block), before vs after
    (after: the worst of its block-size variants).

    Raises:
        ToolMissing: nvcc, cuobjdump or nvdisasm cannot be found (checked before any work).
    """
    for tool in ("nvcc", "cuobjdump", "nvdisasm"):
        find_tool(tool)
    rows_before, rows_after = side(before, repo), side(after, repo, block_sizes=block_sizes)
    pairs = []
    after_decode: dict[tuple, list[dict]] = {}
    for r in rows_after:
        if _is_decode(r["kernel"]):
            after_decode.setdefault(decode_shape(r["kernel"]), []).append(r)
    for r in rows_before:
        if not _is_decode(r["kernel"]):
            continue
        variants = after_decode.get(decode_shape(r["kernel"]), [])
        if not variants or "instructions_per_16B" not in r:
            continue
        worst = max(variants, key=lambda v: v.get("instructions_per_16B", 0))
        pairs.append({"shape": decode_shape(r["kernel"]), "before": r, "after": worst,
                      "ratio": worst.get("instructions_per_16B", float("nan")) / r["instructions_per_16B"]})
    return {"before_ref": before, "after_ref": after, "arch": ARCH, "before": rows_before, "after": rows_after,
            "decode_pairs": pairs}


def format_comparison(result: dict) -> str:
    """The comparison as text: decode side by side, then every other instantiation of `after`."""
    lines = [f"bench kernel --static: {result['arch']}, before = {result['before_ref']}, "
             f"after = {'working tree' if result['after_ref'] == '.' else result['after_ref']}",
             "decode main loop: SASS instructions per 16 bytes of K/V loaded (after: worst block size)",
             f"{'storage':<7} {'hd':>4} {'G':>2} | {'regs':>4} {'spill':>5} {'occ':>5} {'ins/16B':>7} | "
             f"{'regs':>4} {'spill':>5} {'occ':>5} {'ins/16B':>7} | {'ratio':>5}"]
    for p in result["decode_pairs"]:
        b, a = p["before"], p["after"]
        lines.append(f"{p['shape'][0]:<7} {p['shape'][1]:>4} {p['shape'][2]:>2} | {b['registers']:>4} "
                     f"{b['spill_bytes']:>5} {b['occupancy']:>5.3f} {b['instructions_per_16B']:>7.1f} | "
                     f"{a['registers']:>4} {a['spill_bytes']:>5} {a['occupancy']:>5.3f} "
                     f"{a.get('instructions_per_16B', float('nan')):>7.1f} | {p['ratio']:>5.2f}")
    lines.append("every instantiation, after:")
    lines.append(f"{'kernel':<44} {'regs':>4} {'spill':>5} {'smem':>6} {'occ':>5} {'ins/16B':>7}")
    for r in result["after"]:
        per = r.get("instructions_per_16B")
        lines.append(f"{r['kernel']:<44} {r['registers']:>4} {r['spill_bytes']:>5} {r['smem']:>6} "
                     f"{r['occupancy']:>5.3f} {'' if per is None else f'{per:7.1f}':>7}")
    return "\n".join(lines)
