"""Write a run's outputs safely: all files appear together, the previous output stays otherwise,
and nothing graphcal did not write is ever deleted.

The rules for an output folder (``-o``):

- graphcal replaces a folder only if it is empty or holds its own output, recognised by content:
  the manifest (``.graphcal-manifest.json``) written into every output lists each file with its
  size and sha256, and every entry of the folder must be a regular file the manifest lists,
  unchanged. A folder, a link, an edited or an unlisted file, or no manifest (a user's folder):
  the run is refused before calibrating. An older graphcal's manifest (format 1: size and mtime)
  is still honoured by size and mtime.
- ``-o`` may not be a symbolic link (graphcal says where it points), a mount point (the folder is
  replaced whole, which a mount point cannot be) or a folder holding an input, whether the input
  is given through a link or not.
- :func:`reserve_output` takes a lock beside ``-o`` (``.NAME.graphcal-lock``, ``flock``) at the
  start of a run, so a second run on the same ``-o`` fails at once instead of racing; holding it,
  it removes the temporary folders (``.NAME.tmp-*``, ``.NAME.old-*``) that killed runs left
  beside ``-o``, recognised by their marker file or manifest; others are named in a warning.
- Files are written into a temporary folder beside ``-o`` (its marker written first), then swapped
  in with two renames; a failed swap puts the previous output back. A killed run leaves the old
  output or the new one, never a mix. The replaced folder's mode and its files' modes are kept; a
  new output gets the umask's modes.
- SIGTERM during the write phase is turned into an interruption (:class:`Terminated`, a
  ``KeyboardInterrupt``) so the temporary folder is removed, as Ctrl-C does; the CLI does so for
  the whole run (:func:`sigterm_as_interrupt`).

The modules, each importing only those before it: :mod:`~graphcal.output.process` (torchrun's
rank, SIGTERM), :mod:`~graphcal.output.manifest` (what a folder's manifest vouches for),
:mod:`~graphcal.output.folder` (the checks on ``-o``; what graphcal may remove),
:mod:`~graphcal.output.lock` (the lock beside ``-o``), :mod:`~graphcal.output.slot` (reserve,
write, swap). :mod:`~graphcal.output.metadata` writes the compressed-tensors files and is imported
on its own (it loads torch).
"""

from graphcal.output.folder import TMP_MARKER, check_output_dir
from graphcal.output.manifest import MANIFEST
from graphcal.output.process import Terminated, sigterm_as_interrupt, torchrun_rank
from graphcal.output.slot import OutputSlot, releases_outputs, reserve_output, write_atomically

MODEL_FILE = "model.onnx"

__all__ = ["MANIFEST", "MODEL_FILE", "TMP_MARKER", "OutputSlot", "Terminated", "check_output_dir", "releases_outputs",
           "reserve_output", "sigterm_as_interrupt", "torchrun_rank", "write_atomically"]
