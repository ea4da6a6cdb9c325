"""Regenerate tests/fixtures/gemma3_tokenizer_ids.json: reference token ids for the default GGUF.

References: HF transformers' own GGUF tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)) and,
where a llama.cpp binding can be imported, llama.cpp's tokenizer (add_special=True, parse_special=True,
i.e. what llama.cpp's server does with a prompt string). CI never runs this; it only reads the JSON.

llama.cpp: PyPI ships llama-cpp-python as an sdist only, so building it is the usual route (slow). A
prebuilt binding that works is `llama-cpp-py-sync` (CFFI, wheel with libllama.so). Install it in a
separate venv and pass that venv's python as --llama-python; the ids are collected in a subprocess.
(Its wheel needs glibc >= 2.38 only for the C23 `__isoc23_strto*`/`__isoc23_sscanf` aliases; on an older
glibc, mark those version needs weak and LD_PRELOAD a shim that forwards them to strtol & co.)

Usage: python scripts/make_tokenizer_fixtures.py [--gguf PATH] [--llama-python /venv/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "tests" / "fixtures" / "gemma3_tokenizer_ids.json"
BOS_ID = 2

TEXTS = [
    "",
    "Hello world",
    " leading space",
    "The capital of France is Paris.",
    "def f(x):\n    if x:\n        return x * 2\n\treturn 0\n",
    "中文分词测试：你好，世界！",
    "Emoji 😀👍🏽 and flags 🇫🇷 end",
    "runs   of    spaces\n\n\nand\n\n newlines  ",
    "tabs\there\t\tand\t\t\tthere",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already has bos",
    "naïve café résumé Ünïcödé",
    "1234567890 3.14159 1e-9 0xFF",
    "    ",
    "\n",
    "https://example.com/path?q=1&r=2#frag",
]

# Runs inside the llama.cpp venv: reads {"gguf", "texts"} on stdin, writes ids as JSON on stdout.
_LLAMA_CHILD = r"""
import json, sys
req = json.load(sys.stdin)
try:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=req["gguf"], vocab_only=True, verbose=False)
    tok = lambda t, bos: llm.tokenize(t.encode(), add_bos=bos, special=True)
    name, version = "llama-cpp-python", llama_cpp.__version__
except ImportError:
    import llama_cpp_py_sync as lcs
    llm = lcs.Llama(req["gguf"], n_ctx=64, verbose=False)
    tok = lambda t, bos: llm.tokenize(t, add_special=bos, parse_special=True)
    name, version = "llama-cpp-py-sync", f"{lcs.__version__} (llama.cpp {lcs.__llama_cpp_tag__})"
out = {"package": name, "version": version,
       "ids": [tok(t, True) for t in req["texts"]], "ids_no_special": [tok(t, False) for t in req["texts"]]}
print("\n" + json.dumps(out))
"""


def llama_cpp_ids(gguf: Path, python: str) -> dict | None:
    req = json.dumps({"gguf": str(gguf), "texts": TEXTS})
    proc = subprocess.run(
        [python, "-c", _LLAMA_CHILD], check=False, input=req, capture_output=True, text=True, env=os.environ
    )
    if proc.returncode != 0:
        print(f"llama.cpp tokenization failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: the packaged Gemma 3 270M GGUF")
    ap.add_argument("--llama-python", default=None, help="a python that can import llama_cpp or llama_cpp_py_sync")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    from kvserve.model.source import default_model_path

    gguf = (args.gguf or default_model_path()).resolve()
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    llama = None
    if args.llama_python:
        llama = llama_cpp_ids(gguf, args.llama_python)
    elif _importable("llama_cpp") or _importable("llama_cpp_py_sync"):
        llama = llama_cpp_ids(gguf, sys.executable)

    cases = []
    for i, text in enumerate(TEXTS):
        ids = hf.encode(text, add_special_tokens=True)
        plain = hf.encode(text, add_special_tokens=False)
        # kvserve's rule: BOS once, even where HF and llama.cpp give two (text that starts with "<bos>").
        kvserve_ids = plain if plain[:1] == [BOS_ID] else [BOS_ID, *plain]
        case = {
            "text": text,
            "hf_ids": ids,
            "hf_ids_no_special": plain,
            "kvserve_ids": kvserve_ids,
            "decoded_no_special": hf.decode(plain, skip_special_tokens=False),
        }
        if llama is not None:
            case["llama_cpp_ids"] = llama["ids"][i]
            case["llama_cpp_ids_no_special"] = llama["ids_no_special"][i]
            if llama["ids"][i] != ids or llama["ids_no_special"][i] != plain:
                print(f"NOTE: HF and llama.cpp differ on {text!r}", file=sys.stderr)
        cases.append(case)
    fixture = {
        "model_file": gguf.name,
        "model_file_size": gguf.stat().st_size,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "llama_cpp": None
        if llama is None
        else {
            "package": llama["package"],
            "version": llama["version"],
            "flags": "add_special (BOS) as named, parse_special=True",
        },
        "bos_token_id": BOS_ID,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(cases)} cases, llama.cpp: {'yes' if llama else 'no'})")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
