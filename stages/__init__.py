"""The stages, one module or package each (`run(config) -> Path`), found by name through
pipeline/registry.py; a stage never imports another (import-linter's `stages` contract).
Beside them: `common/` (what several stages share), `configs/` (each stage's config), `presets/`.
"""
