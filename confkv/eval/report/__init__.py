"""Reports: page (one Markdown / HTML page from a results folder), plots (PNG plots, headless matplotlib)."""

from confkv._moved import old_module_names

# the old module confkv.eval.report is this package now: its names, for one release
__getattr__ = old_module_names(__name__, "confkv.eval.report.page", ("build_report", "markdown_to_html"))
