"""What tests, benchmarks and scripts share: tiny random-weight models, the real SmolLM2.

A source checkout's own helpers, imported as ``kvserve.testing`` (as ``numpy.testing`` or
``kopf.testing``): setup.py maps this folder into the namespace only when it exists, so an
editable install (``make install``) finds it from tests/, bench/ and scripts/ without touching
``sys.path``, and the image, whose build context leaves it out, does not ship it. Nothing in
``kvserve.runtime``, ``kernels`` or ``operator`` may import it.
"""
