# Package marker (torchtitan/models/__init__.py is not copied).
