//! Checking a safetensors file's header before the safetensors crate reads it: the base weights,
//! the adapter and the pointer head all come as safetensors files.

use std::path::Path;

use kev_core::{Error, Result};

/// Reads a safetensors header strictly before the safetensors crate does: its declared length
/// is checked against the file's before anything is allocated, and a tensor named twice in it
/// (which a map would resolve silently to one of the two) is an error naming the file.
pub(crate) fn check_header(path: &Path) -> Result<()> {
    use std::io::Read;
    let bad = |message: String| Error::Tensor {
        name: "(header)".into(),
        message: format!("`{}`: {message}", path.display()),
    };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| {
        bad(format!(
            "{file_len} bytes is too short for a safetensors file"
        ))
    })?;
    let n = u64::from_le_bytes(len);
    if n > file_len - 8 || n > 100 << 20 {
        return Err(bad(format!(
            "the header declares {n} bytes but the file has {} after the length (and headers are at most 100 MiB)",
            file_len - 8
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| Error::io(path, e))?;
    let text =
        std::str::from_utf8(&header).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    kev_core::json::parse_strict(text).map_err(|e| bad(format!("header: {e}")))?;
    Ok(())
}
