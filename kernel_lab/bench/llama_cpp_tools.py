"""llama.cpp's own tools as baselines: llama-bench, llama-batched-bench, llama-server, llama-lookup and
llama-speculative, as projects/09_engine/llama_cpp_tools.sh builds them from the pinned source
(`make llama-cpp-env`).

Where the binaries are (`find_tools`, one bin directory per build: `native`, or `avx2` for an AVX2 machine's
build), what each build was (its llama-cpp-build.json: the llama.cpp commit, CMake and compiler flags, the CPU's
ISA flags, copied into every record as `provenance`), the command lines the benchmarks run, and parsers of
the tools' output: llama-bench's `-o json` list, llama-batched-bench's markdown table and the speculative
examples' closing summary.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS_ROOT = REPO / ".venv-llamacpp" / "llama.cpp"
# The build directory of each variant llama_cpp_tools.sh makes.
BUILDS = {"native": "build", "avx2": "build-avx2"}
INFO_FILE = "llama-cpp-build.json"
HOST = "127.0.0.1"  # llama-server listens on loopback only


@dataclass(frozen=True)
class LlamaCppTools:
    """One build's bin directory and what llama_cpp_tools.sh recorded about it."""

    bin_dir: Path
    info: dict

    def path(self, tool: str) -> Path:
        binary = self.bin_dir / tool
        if tool not in self.info["tools"] or not binary.exists():
            raise FileNotFoundError(f"the {self.info['variant']} llama.cpp build has no {tool} (built: "
                                    f"{', '.join(self.info['tools'])}) in {self.bin_dir}")
        return binary

    def provenance(self, tool: str) -> dict:
        """What a record says about the baseline: the tool, its build and the CPU it was built on."""
        return {"tool": tool, "build": self.info["variant"], "llama_cpp_commit": self.info["llama_cpp_commit"],
                "llama_cpp_python_sdist": self.info["llama_cpp_python_version"],
                "cmake_flags": self.info["cmake_flags"], "compiler_flags": self.info["compiler_flags"],
                "cpu": self.info["built_on_cpu"], "cpu_isa": self.info["built_on_cpu_isa"]}


def find_tools(build: str = "native", root: Path | None = None) -> LlamaCppTools:
    """The tools of one build (`native` or `avx2`) under `root` (default TOOLS_ROOT, read at call time);
    FileNotFoundError naming the command that builds them."""
    if build not in BUILDS:
        raise ValueError(f"build must be one of {', '.join(BUILDS)}; got {build!r}")
    bin_dir = Path(TOOLS_ROOT if root is None else root) / BUILDS[build] / "bin"
    info = bin_dir / INFO_FILE
    if not info.exists():
        how = "make llama-cpp-env" if build == "native" else "make llama-cpp-env LLAMA_CPP_AVX2=1"
        raise FileNotFoundError(f"no {build} build of llama.cpp's tools at {bin_dir} (no {INFO_FILE}): run `{how}`")
    return LlamaCppTools(bin_dir, json.loads(info.read_text()))


def missing(build: str = "native", tools: tuple[str, ...] = ("llama-bench",), root: Path | None = None) -> str | None:
    """Why these tools of a build cannot run here (None when they can): for skips and notes."""
    try:
        found = find_tools(build, root)
        for tool in tools:
            found.path(tool)
    except FileNotFoundError as exc:
        return str(exc)
    return None


# ====================================================================== command lines
def llama_bench_command(binary: Path, model: Path, threads: int, prompt_len: int = 0, gen_len: int = 0,
                        repetitions: int = 1, depth: int = 0, cache_type: str | None = None) -> list[str]:
    """One llama-bench test: ppN (`prompt_len`, gen_len 0) or tgN (`gen_len`, prompt_len 0), as JSON; after
    `depth` context tokens (`-d`, 0: none), with K and V caches of `cache_type` (`-ctk`/`-ctv`, e.g. f16 or
    q8_0; None: llama-bench's default)."""
    if (prompt_len > 0) == (gen_len > 0) or min(prompt_len, gen_len) < 0:
        raise ValueError(f"exactly one of prompt_len and gen_len must be positive; got {prompt_len} and {gen_len}")
    if threads < 1 or repetitions < 1 or depth < 0:
        raise ValueError(f"threads and repetitions must be >= 1 and depth >= 0; got {threads}, {repetitions}, "
                         f"{depth}")
    return [str(binary), "-m", str(model), "-p", str(prompt_len), "-n", str(gen_len), "-t", str(threads),
            "-r", str(repetitions), "-o", "json", *(["-d", str(depth)] if depth else []),
            *(["-ctk", cache_type, "-ctv", cache_type] if cache_type else [])]


def batched_bench_command(binary: Path, model: Path, prompt_len: int, gen_len: int, batch: int,
                          threads: int) -> list[str]:
    """llama-batched-bench with `batch` sequences of prompt_len + gen_len tokens; the context holds them all."""
    if min(prompt_len, gen_len, batch, threads) < 1:
        raise ValueError(f"prompt_len, gen_len, batch and threads must be >= 1; got {prompt_len}, {gen_len}, "
                         f"{batch}, {threads}")
    return [str(binary), "-m", str(model), "-c", str(batch * (prompt_len + gen_len)), "-b", "2048", "-ub", "512",
            "-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", str(batch), "-t", str(threads)]


def llama_server_command(binary: Path, model: Path, port: int, parallel: int, threads: int,
                         context_per_slot: int) -> list[str]:
    """llama-server on loopback with `parallel` slots of `context_per_slot` tokens, continuous batching."""
    if min(parallel, threads, context_per_slot) < 1 or not 0 < port < 65536:
        raise ValueError(f"parallel, threads and context_per_slot must be >= 1 and port in 1..65535; got "
                         f"{parallel}, {threads}, {context_per_slot}, {port}")
    return [str(binary), "-m", str(model), "--host", HOST, "--port", str(port), "-np", str(parallel), "-cb",
            "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads)]


def speculation_command(binary: Path, model: Path, prompt_file: Path, max_tokens: int, threads: int,
                        draft_max: int, draft_model: Path | None = None, context: int = 2048,
                        flash_attn: str = "off") -> list[str]:
    """One greedy completion of the prompt in `prompt_file` by llama-lookup (prompt-lookup n-gram drafts of up
    to `draft_max` tokens; 0: no drafts, plain decoding in the same program) or, with `draft_model`,
    llama-speculative (that model drafts `draft_max` tokens for `model`). `flash_attn` off by default: on a
    2-core Xeon the examples' default (auto, so on) decoded the bundled model at half the speed at 320 tokens
    of context, and the baseline should be llama.cpp at its best."""
    if max_tokens < 1 or threads < 1 or draft_max < 0 or context < 1:
        raise ValueError(f"max_tokens, threads and context must be >= 1 and draft_max >= 0; got {max_tokens}, "
                         f"{threads}, {context}, {draft_max}")
    return [str(binary), "-m", str(model), *(["-md", str(draft_model)] if draft_model is not None else []),
            "-f", str(prompt_file), "-n", str(max_tokens), "--spec-draft-n-max", str(draft_max), "-t", str(threads),
            "--temp", "0", "-c", str(context), "-fa", flash_attn]


def run_tool(command: list[str], timeout: float = 1800) -> str:
    """The tool's stdout; RuntimeError with the end of its stderr when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} exited with {result.returncode}: "
                           f"{result.stderr.strip()[-2000:]}")
    return result.stdout


# ====================================================================== parsers
def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's `-o json` output: one dict per test, with n_prompt, n_gen, n_threads, avg_ts and
    stddev_ts (tokens/s), samples_ts, build_commit and cpu_info as llama-bench wrote them."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench output is not JSON: {exc}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench output holds no tests (expected a non-empty JSON list)")
    for test in tests:
        absent = [k for k in ("n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts") if k not in test]
        if absent:
            raise ValueError(f"a llama-bench test lacks {', '.join(absent)}")
    return tests


# llama-batched-bench's column headers and the keys parse_batched_bench gives them
BATCHED_COLUMNS = {"PP": "pp", "TG": "tg", "B": "b", "N_KV": "n_kv", "T_PP s": "t_pp_s", "S_PP t/s": "s_pp_tok_s",
                   "T_TG s": "t_tg_s", "S_TG t/s": "s_tg_tok_s", "T s": "t_s", "S t/s": "s_tok_s"}


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's table, one dict per row (keys of BATCHED_COLUMNS; PP, TG, B and N_KV as ints).
    `s_tok_s` is B x (PP + TG) / T: total tokens/s."""
    rows, header = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "S t/s" in cells:
                unknown = [c for c in cells if c not in BATCHED_COLUMNS]
                if unknown:
                    raise ValueError(f"llama-batched-bench table has unknown columns {unknown}")
                header = [BATCHED_COLUMNS[c] for c in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the separator row
        if len(cells) != len(header):
            raise ValueError(f"llama-batched-bench row {line!r} has {len(cells)} cells; the header has {len(header)}")
        row = {k: float(v) for k, v in zip(header, cells)}
        rows.append({k: int(v) if k in ("pp", "tg", "b", "n_kv") else v for k, v in row.items()})
    if not rows:
        raise ValueError("no llama-batched-bench table (a '| PP | TG | B | ... | S t/s |' header, then rows) in "
                         "the output")
    return rows


_SPECULATION_FIELDS = {
    "prompt": re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def parse_speculation(text: str) -> dict:
    """The summary llama-lookup and llama-speculative log at the end: prompt tokens and seconds (`encoded`),
    generated tokens and seconds (`decoded`), tokens drafted and accepted."""
    found = {name: pattern.search(text) for name, pattern in _SPECULATION_FIELDS.items()}
    absent = [name for name, match in found.items() if match is None]
    if absent:
        raise ValueError(f"no {', '.join(absent)} line in the tool's summary (expected 'encoded N tokens in S "
                         f"seconds', 'decoded N tokens in S seconds', 'n_drafted = N', 'n_accept = N')")
    return {"prompt_tokens": int(found["prompt"][1]), "prompt_s": float(found["prompt"][2]),
            "tokens": int(found["decoded"][1]), "decode_s": float(found["decoded"][2]),
            "drafted": int(found["drafted"][1]), "accepted": int(found["accepted"][1])}


def run_speculation(command: list[str], timeout: float = 1800) -> dict:
    """Run a speculation_command; its parsed summary (the examples log it to stderr)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} exited with {result.returncode}: "
                           f"{result.stderr.strip()[-2000:]}")
    return parse_speculation(result.stderr + result.stdout)


# ====================================================================== one measurement
def measure(tools: LlamaCppTools, model: Path, threads: int, *, prompt_len: int = 0, gen_len: int = 0,
            batch: int = 0, depth: int = 0, cache_type: str | None = None) -> dict:
    """One run of the tool that covers a point, and what it measured as `tok_s`:
    - batch 0, gen_len N: llama-bench tgN, batch-1 decode tok/s;
    - batch 0, prompt_len N: llama-bench ppN, prompt tok/s;
    - batch B >= 1 with both lengths: llama-batched-bench, B sequences of prompt_len + gen_len, S t/s
      (B x (PP + TG) / wall time: total tok/s)."""
    if batch:
        tool = "llama-batched-bench"
        command = batched_bench_command(tools.path(tool), model, prompt_len, gen_len, batch, threads)
        (row,) = parse_batched_bench(run_tool(command))
        quantity, tok_s, parsed = "total tok/s (S t/s: B x (PP + TG) / T)", row["s_tok_s"], row
    else:
        tool = "llama-bench"
        command = llama_bench_command(tools.path(tool), model, threads, prompt_len, gen_len, depth=depth,
                                      cache_type=cache_type)
        (parsed,) = parse_llama_bench(run_tool(command))
        test = (f"pp{prompt_len}" if prompt_len else f"tg{gen_len}") + (f" @ d{depth}" if depth else "")
        quantity = f"{test} avg_ts: " + ("prompt tok/s" if prompt_len else "batch-1 decode tok/s")
        tok_s = parsed["avg_ts"]
    return {"tool": tool, "quantity": quantity, "tok_s": float(tok_s), "threads": threads, "prompt_len": prompt_len,
            "gen_len": gen_len, "batch": batch, "depth": depth, "cache_type": cache_type, "command": command,
            "output": parsed, **tools.provenance(tool)}
