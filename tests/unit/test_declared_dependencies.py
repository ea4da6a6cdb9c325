"""Every third-party package that kvserve's own modules import is declared in its core dependencies (or, for an
optional feature whose import is guarded, in that feature's extra): a fresh `pip install -e .` must not leave an
import that only a hand-installed package satisfied (matplotlib and httpx were both used before they were declared).

Read from the source with ast (every import, including the lazy ones inside functions, which are the ones a quick
smoke test misses) and from the installed kvserve metadata: after editing pyproject.toml, `pip install -e .` again
refreshes that metadata."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"

# Imports allowed outside the core dependencies: import name -> (distribution, the extra that declares it). Each is
# imported only inside a function on its feature's path, behind a clear error when missing.
OPTIONAL_IMPORTS = {
    # --data-parallel-size N > 1 and `kvserve bench router`: server/cli.py and bench/router.py catch ImportError
    # and say `pip install -e '.[cluster]'`; cluster/engine.py is reached only after that check.
    "ray": ("ray", "cluster"),
    # --attention-backend triton (the CUDA default): attention/triton.py imports attention/triton_kernels.py, the
    # one module that imports triton, at the first call, and says `pip install -e '.[cuda]'` if it is missing.
    "triton": ("triton", "cuda"),
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(root: Path) -> dict[str, set[str]]:
    """Top package name of every absolute import under root that is neither kvserve nor stdlib -> the files."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "kvserve" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(root.parent)))
    return found


def declared(extra: str | None) -> set[str]:
    """kvserve's Requires-Dist names: the core ones (no marker) when extra is None, else those of that extra."""
    names = set()
    for line in installed_requirements():
        req = Requirement(line)
        if extra is None and req.marker is None:
            names.add(_normalize(req.name))
        elif extra is not None and req.marker is not None and req.marker.evaluate({"extra": extra}):
            names.add(_normalize(req.name))
    return names


def installed_requirements() -> list[str]:
    """The Requires-Dist lines of the installed kvserve. Every kvserve metadata visible on sys.path must agree: a
    stale kvserve.egg-info left in the source tree by an old build shadows the installed metadata whenever the tree
    is the working directory (as when pytest runs), and would make this check read an old dependency list."""
    found = {str(getattr(d, "_path", "?")): sorted(d.requires or []) for d in md.distributions(name="kvserve")}
    assert found, "kvserve is not installed: pip install -e ."
    assert len({tuple(r) for r in found.values()}) == 1, (
        f"kvserve metadata disagree between {sorted(found)}: delete the stale one, or pip install -e . again"
    )
    return next(iter(found.values()))


def test_the_walk_sees_lazy_imports_and_skips_stdlib_and_relative(tmp_path):
    pkg = tmp_path / "kvserve"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import os, json\nimport numpy.linalg\nfrom . import b\n"
        "def f():\n    from matplotlib import pyplot\n    import kvserve.x\n"
    )
    assert third_party_imports(pkg) == {"numpy": {"kvserve/a.py"}, "matplotlib": {"kvserve/a.py"}}


def test_every_import_of_the_package_is_a_declared_dependency():
    distributions = md.packages_distributions()
    core = declared(None)
    missing = []
    for name, files in sorted(third_party_imports(PACKAGE).items()):
        if name in OPTIONAL_IMPORTS:
            dist, extra = OPTIONAL_IMPORTS[name]
            if _normalize(dist) not in declared(extra):
                missing.append(f"{name} ({dist}) is not in the [{extra}] extra")
            continue
        dists = {_normalize(d) for d in distributions.get(name, [])}
        if not dists:
            missing.append(f"{name}: not installed, imported by {sorted(files)}")
        elif not dists & core:
            missing.append(
                f"{name} ({', '.join(sorted(dists))}) is imported by {sorted(files)} but is not a core "
                f"dependency (declare it in [project].dependencies, or guard it and list it above)"
            )
    assert not missing, "\n".join(missing)


def test_the_allow_list_is_still_needed():
    """An optional import that the package no longer makes, or that became a core dependency, leaves the list."""
    imports = third_party_imports(PACKAGE)
    core = declared(None)
    for name, (dist, _) in OPTIONAL_IMPORTS.items():
        assert name in imports, f"{name} is no longer imported: drop it from OPTIONAL_IMPORTS"
        assert _normalize(dist) not in core, f"{dist} is a core dependency now: drop it from OPTIONAL_IMPORTS"


def test_a_cpu_install_runs_structured_output_without_triton(tmp_path) -> None:
    """xgrammar declares triton on Linux x86_64 (999 MB of the 3 GB a plain install takes) though kvserve never uses
    it on a CPU: README says `pip uninstall -y triton` is safe there. A greedy generation under xgrammar's JSON grammar,
    in a process where `import triton` fails, gives the same JSON as in one where it works."""
    import json
    import subprocess

    models = Path(__file__).resolve().parents[1] / "models"
    script = f"""
import json, sys
from pathlib import Path
if sys.argv[1] == "blocked":
    sys.modules["triton"] = None  # `import triton` raises ImportError, as when it is not installed
sys.path.insert(0, {str(models)!r})
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer
from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
build_tiny_hf_model("llama_gqa").save_pretrained({str(tmp_path)!r})
write_char_tokenizer(Path({str(tmp_path)!r}))
llm = LLM(model={str(tmp_path)!r}, num_gpu_blocks_override=64, block_size=4, structured_outputs_backend="xgrammar")
schema = {{"type": "object", "properties": {{"a": {{"type": "integer"}}}}, "required": ["a"]}}
params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
text = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].text
print(json.dumps({{"text": text, "triton": "triton" in sys.modules and sys.modules["triton"] is not None}}))
"""
    runs = {}
    for mode in ("blocked", "allowed"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["blocked"]["triton"] is False
    assert runs["blocked"]["text"] == runs["allowed"]["text"] and json.loads(runs["blocked"]["text"])["a"] is not None
