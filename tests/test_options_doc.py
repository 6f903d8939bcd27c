"""lmi_handler.options_doc: docs/configuration.md's options tables are config/'s Settings, rendered part by
part; `make docs` writes them there."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lmi_handler.config import PARTS, Settings
from lmi_handler.options_doc import END, REGENERATE, START, render_table, replace_table
from tests.helpers import REPO

PAGE = REPO / "docs" / "configuration.md"


def test_the_options_table_in_docs_configuration_is_config_pys_settings_rendered():
    text = PAGE.read_text(encoding="utf-8")
    assert START in text and END in text, f"{PAGE} lost its option markers"
    table = START + text.split(START, 1)[1].split(END, 1)[0] + END
    assert table == render_table(), f"docs/configuration.md's options table differs from config.py; run: {REGENERATE}"


def test_every_settings_field_has_a_row_naming_its_key_default_and_docstring():
    rows = {row.split("`")[1]: row for row in render_table().splitlines() if row.startswith("| `")}
    assert len(rows) == len(Settings.model_fields)
    assert "[1, 1024]" in rows["option.max_rolling_batch_size"] and "| 32 |" in rows["option.max_rolling_batch_size"]
    assert "(0, 3600]" in rows["option.structured_output_compile_timeout_s"]
    assert "1073741824 (1 GiB)" in rows["option.kv_cache_bytes"] and "≥ 1048576" in rows["option.kv_cache_bytes"]
    assert "one of `auto`, `amx`, `native`, `fma`" in rows["option.bf16_kernel"]
    assert "secret text or unset" in rows["option.api_key"] and "`LMI_API_KEY`" in rows["option.api_key"]
    assert "`SERVING_JOB_QUEUE_SIZE`" in rows["job_queue_size"]            # a top-level key: no option. prefix
    assert "Most requests decoded together" in rows["option.max_rolling_batch_size"]
    assert "auto \\| fp32" in rows["option.dtype"]                         # a | in a docstring keeps the columns


def test_each_part_gets_its_own_heading_and_table_in_part_order_and_every_field_sits_in_its_parts():
    table = render_table()
    headings = [line for line in table.splitlines() if line.startswith("### ")]
    assert headings == ["### Model", "### Engine", "### LoRA adapters", "### Serving", "### Chat", "### Images",
                        "### Batch jobs", "### Pooling"]
    sections = dict(zip(headings, table.split("### ")[1:]))
    assert "`option.dtype`" in sections["### Model"] and "`option.block_size`" in sections["### Engine"]
    assert "`option.max_loras`" in sections["### LoRA adapters"] and "`job_queue_size`" in sections["### Serving"]
    assert "`option.tool_call_parser`" in sections["### Chat"] and "`option.batch_dir`" in sections["### Batch jobs"]
    assert "`option.task`" in sections["### Pooling"]
    assert "`option.limit_mm_per_prompt`" in sections["### Images"]
    assert table.count("| key | type |") == len(PARTS)


def test_a_field_without_a_docstring_still_gets_its_row(monkeypatch):
    field = Settings.model_fields["block_size"]
    monkeypatch.setattr(field, "description", None)
    row = next(r for r in render_table().splitlines() if r.startswith("| `option.block_size`"))
    assert row.endswith("| integer | 16 | [1, 256] |  |")


def test_replace_table_keeps_the_page_around_the_markers_and_refuses_a_page_without_them():
    page = f"# Options\n\nbefore\n{START}\nstale\n{END}\nafter\n"
    assert replace_table(page) == f"# Options\n\nbefore\n{render_table()}\nafter\n"
    with pytest.raises(ValueError, match="options:start"):
        replace_table("# no table here\n")


def test_the_command_writes_the_table_into_a_page_and_names_a_page_without_markers(tmp_path):
    page = tmp_path / "configuration.md"
    page.write_text(f"intro\n{START}\n{END}\n")
    command = [sys.executable, "-m", "lmi_handler.options_doc", "--write", str(page)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert page.read_text() == f"intro\n{render_table()}\n"
    page.write_text("no markers\n")
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no options table" in refused.stderr
