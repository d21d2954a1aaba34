"""Results -> people: Markdown, HTML, SVG plots, JUnit XML, the terminal's summary. Reads result objects
and run records only, so a saved run renders again without a model.
May import: errors, names, results. Never engine or tasks."""
