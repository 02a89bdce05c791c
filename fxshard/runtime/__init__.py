"""fxshard's runtime: the collectives and the custom ops that mark parameter
reads in a graph. The lowest layer; it imports nothing else from fxshard."""
