"""The report page: one self-contained HTML file (inline CSS and SVG, no JavaScript, nothing fetched), a section
per what-if with its figures, tables and links to its data files."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
figcaption { font-size: 0.9em; color: #444; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.8em 0; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
caption { text-align: left; font-weight: 600; padding-bottom: 4px; }
.files { font-size: 0.9em; } code { background: #f5f5f5; padding: 0 3px; }
nav a { margin-right: 1em; }
"""


@dataclass(frozen=True)
class Figure:
    id: str
    svg: str
    caption: str


@dataclass(frozen=True)
class Table:
    caption: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Section:
    """One what-if: `intro` and captions are plain text (escaped here); `files` the data files beside the page."""

    id: str
    title: str
    intro: str
    figures: tuple[Figure, ...] = ()
    tables: tuple[Table, ...] = ()
    files: tuple[str, ...] = ()


def _table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    return (
        f"<table><caption>{html.escape(t.caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _section(s: Section) -> str:
    parts = [f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>', f"<p>{html.escape(s.intro)}</p>"]
    for f in s.figures:
        parts.append(f'<figure id="{f.id}">{f.svg}<figcaption>{html.escape(f.caption)}</figcaption></figure>')
    parts += [_table(t) for t in s.tables]
    if s.files:
        links = ", ".join(f'<a href="{html.escape(f)}">{html.escape(f)}</a>' for f in s.files)
        parts.append(f'<p class="files">Data: {links}</p>')
    parts.append("</section>")
    return "\n".join(parts)


def page(title: str, intro: Sequence[str], overview: Table, sections: Sequence[Section], footer: str) -> str:
    """The whole HTML document."""
    nav = " ".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    paras = "".join(f"<p>{html.escape(p)}</p>" for p in intro)
    body = "\n".join(_section(s) for s in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>"
        f"<h1>{html.escape(title)}</h1>{paras}{_table(overview)}<nav>{nav}</nav>\n{body}\n"
        f'<footer><p class="files">{html.escape(footer)}</p></footer></body></html>\n'
    )
