"""The README as a new user's map (issue 54 item 8): every guide in docs/ is listed under Documentation,
and Running shows an MoE run next to the dense ones."""

import re

from tests.helpers import REPO


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_guide_in_docs_is_listed_under_documentation():
    listed = set(re.findall(r"`(docs/[\w.]+)`", _section("Documentation")))
    guides = {f"docs/{p.name}" for p in (REPO / "docs").iterdir() if p.suffix in (".md", ".py")}
    assert guides <= listed, sorted(guides - listed)


def test_running_shows_an_moe_command_with_expert_parallel():
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", _section("Running"), re.S))
    assert "--recipe debug_moe" in commands and "--parallelism.ep=" in commands
