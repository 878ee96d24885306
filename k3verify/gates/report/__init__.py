"""Rendering a run: report.json (schema-validated), HTML, SVG charts, JUnit, the report index and the console."""
