"""Small user-facing texts a new-user review found wrong: README's bootstrap dependency list, and the
demo's token count printed as a dict."""

from __future__ import annotations

import importlib.util
import re
import sys
import types

from support.paths import REPO


def _bootstrap_packages() -> list[str]:
    text = (REPO / "scripts" / "bootstrap_env.sh").read_text()
    names = []
    for line in re.findall(r"^\s*pip_install ((?:[^\n]*\\\n)*[^\n]*)", text, flags=re.M):
        for word in line.replace("\\\n", " ").split("#")[0].split():
            if not word.startswith("-") and not word.startswith('"$'):
                names.append(re.split(r"[=<>]", word)[0])
    return names


def test_readme_lists_every_package_bootstrap_installs():
    names = _bootstrap_packages()
    assert {"transformers", "safetensors", "ruff", "tensorboard", "torch", "megatron-core"} <= set(names)
    readme = (REPO / "README.md").read_text()
    paragraph = readme[readme.index("Each command first creates or reuses `.venv`"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    missing = [n for n in names if n not in {".", "-e"} and n not in paragraph]
    assert not missing, f"README's bootstrap list lacks {missing}"


def test_demo_prints_the_token_count_as_a_number(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("demo_under_test", REPO / "pretrain_scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.setattr(demo, "DATA", str(tmp_path))
    (tmp_path / "sp512.model").write_bytes(b"x")  # the tokenizer step is skipped when its model exists
    fake = types.SimpleNamespace(documents=239, tokens={"text": 514147})
    import megatron_het.data as data

    monkeypatch.setattr(data, "preprocess", lambda config, **kw: fake)
    demo.prepare_data()
    assert "demo: preprocessed 239 documents, 514147 tokens" in capsys.readouterr().out
    assert "demo_under_test" not in sys.modules
