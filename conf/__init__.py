"""Config files, shipped as package data so an installed `keel` finds them."""
