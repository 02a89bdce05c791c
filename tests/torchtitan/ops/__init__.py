# Package marker (torchtitan/ops/__init__.py is not copied).
