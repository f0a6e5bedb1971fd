"""Benchmarks of tfgpt; see bench/RESULTS.md."""


def print_table(header, rows):
    """Prints a Markdown table, the first column left-aligned, the others right."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(  # noqa: E731
        str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
