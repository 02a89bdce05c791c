# Package marker (torchtitan/protocols/__init__.py is not copied).
