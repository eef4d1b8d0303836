"""A folder of ours alone at a predictable path in a shared place (the system's temporary folder):
another user could have made it first, or put a link there, and then read what we write or plant what
we load. Used for the MPS daemon's pipe folders and the scan check's compiled library."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def own_private_folder(folder: Path) -> None:
    """Makes `folder` (mode 0700) or takes the one there if it is a real folder (no link) of this user,
    setting its mode to 0700 again (one left by an older run keeps working). Raises PermissionError
    otherwise, and OSError where it cannot be made."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{folder} is not a folder (a link or a file)")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{folder} belongs to another user")
    os.chmod(folder, 0o700)
