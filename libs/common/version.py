"""The running omnirelay version (from the installed distribution's metadata)."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("omnirelay")
except PackageNotFoundError:  # running from a source tree without installation
    VERSION = "0.0.0+source"
