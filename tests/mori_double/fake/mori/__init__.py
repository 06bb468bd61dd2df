"""The MORI test double (tests/mori_double): the real package's layout, emulated in torch."""
__version__ = "1.2.4"
__atom_ray_double__ = True
