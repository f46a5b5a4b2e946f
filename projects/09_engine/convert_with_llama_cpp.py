"""Convert Hugging Face checkpoints to float32 GGUFs with llama.cpp's own converter, many in one process.

    python projects/09_engine/convert_with_llama_cpp.py .llama-cpp-converter/convert_hf_to_gguf.py
    stdin, one JSON line per checkpoint:  ["checkpoint directory", "out.gguf"]
    stdout, one JSON line each:           null, or the converter's error ("Type: message")

The converter (`make llama-cpp-converter`) runs in this process once per line; its imports (torch,
transformers, its conversion package: most of a conversion's ten seconds) are paid once. Its log goes to
stderr. It imports sentencepiece before it looks for a tokenizer.model, and where there is none (the tiny test
checkpoints) reads tokenizer.json instead: where sentencepiece is not installed an empty module stands in for
it, never called.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import runpy
import sys
import traceback
import types


def main(converter: str) -> None:
    if importlib.util.find_spec("sentencepiece") is None:
        stub = types.ModuleType("sentencepiece")
        stub.__spec__ = importlib.machinery.ModuleSpec("sentencepiece", None)
        stub.SentencePieceProcessor = None
        sys.modules["sentencepiece"] = stub
    sys.path.insert(0, converter.rsplit("/", 1)[0])  # its conversion package (it finds its gguf-py itself)
    replies = sys.stdout
    for line in sys.stdin:
        source, out = json.loads(line)
        sys.argv = [converter, source, "--outtype", "f32", "--outfile", out]
        try:
            with contextlib.redirect_stdout(sys.stderr):
                runpy.run_path(converter, run_name="__main__")
            reply = None
        except (Exception, SystemExit) as exc:
            traceback.print_exc()
            reply = f"{type(exc).__name__}: {exc}"
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(sys.argv[1])
