"""ExportError, the one error of the export package, in a module of its own: every module of the
package raises it, and the package's ``__init__``, where callers import it from, imports them all;
defined there, each module would import the package that imports it (a cycle)."""


class ExportError(RuntimeError):
    """A model, checkpoint or folder that cannot be exported or loaded as asked."""
