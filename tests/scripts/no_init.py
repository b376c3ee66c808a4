"""A script that ends without ever calling hotspare.init(), as `train.py --help` does."""
print("usage: no_init.py [--help]")
