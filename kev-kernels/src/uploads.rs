//! Host-to-device uploads through one door ([`upload`]), so that a CUDA graph can be captured
//! from the same host code that runs a forward eagerly.
//!
//! A captured graph may not copy from pageable host memory, and its replays must find the small
//! host-built tensors of a forward (row lengths, RoPE positions, masks, row indices) where the
//! capture saw them. So the caller first runs the forward eagerly under [`recording`], which
//! keeps every upload in an [`UploadMemo`] keyed by its content, then captures it under
//! [`replaying`], where each upload returns the recorded tensor instead of copying; an upload
//! that was not recorded fails the capture rather than baking in a copy. Outside these two
//! scopes [`upload`] is a plain `Tensor::from_vec`.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{bail, DType, Device, Result, Shape, Tensor, WithDType};

/// A value that can be uploaded and used as a memo key (the types Kev's forward uploads).
pub trait Upload: WithDType {
    /// The value's bytes (little-endian), part of the memo key.
    fn key_bytes(values: &[Self]) -> Vec<u8>;

    /// `values` copied to `dev` with cudarc directly: candle's own upload keeps every small
    /// copy made while its graph cache is on, forever; the memo's copies live with their graph.
    #[cfg(feature = "cuda")]
    fn to_cuda(values: &[Self], dev: &candle_core::CudaDevice) -> Result<candle_core::CudaStorage>;
}

macro_rules! upload_impl {
    ($t:ty) => {
        impl Upload for $t {
            fn key_bytes(values: &[Self]) -> Vec<u8> {
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            }

            #[cfg(feature = "cuda")]
            fn to_cuda(
                values: &[Self],
                dev: &candle_core::CudaDevice,
            ) -> Result<candle_core::CudaStorage> {
                use candle_core::cuda_backend::WrapErr;
                let slice = dev.cuda_stream().clone_htod(values).w()?;
                Ok(candle_core::CudaStorage::wrap_cuda_slice(
                    slice,
                    dev.clone(),
                ))
            }
        }
    };
}
upload_impl!(u32);
upload_impl!(f32);
upload_impl!(half::bf16);
upload_impl!(half::f16);

/// A memo's copy of `values`, not through candle's graph cache where there is a choice.
fn copy<T: Upload>(values: Vec<T>, shape: Shape, device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if values.len() != shape.elem_count() {
            bail!("upload of {} values as {shape:?}", values.len())
        }
        let storage = candle_core::Storage::Cuda(T::to_cuda(&values, dev)?);
        return Ok(Tensor::from_storage(
            storage,
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        ));
    }
    Tensor::from_vec(values, shape, device)
}

#[derive(PartialEq, Eq, Hash)]
struct Key {
    dtype: DType,
    dims: Vec<usize>,
    bytes: Vec<u8>,
}

/// The uploads of one recorded forward, by content. Keeps their device tensors alive: a graph
/// captured under [`replaying`] reads them, so the memo must live as long as the graph.
#[derive(Default)]
pub struct UploadMemo {
    tensors: HashMap<Key, Tensor>,
}

impl UploadMemo {
    /// Number of distinct uploads recorded.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether nothing was uploaded.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

enum Mode {
    Direct,
    Record(UploadMemo),
    Replay(UploadMemo),
}

thread_local! {
    static MODE: RefCell<Mode> = const { RefCell::new(Mode::Direct) };
}

/// `values` as a tensor of `shape` on `device`: a copy, or under [`recording`] / [`replaying`]
/// the memo's tensor of the same content.
pub fn upload<T: Upload>(
    values: Vec<T>,
    shape: impl Into<Shape>,
    device: &Device,
) -> Result<Tensor> {
    let shape = shape.into();
    MODE.with(|mode| {
        let mut mode = mode.borrow_mut();
        let (memo, replaying) = match &mut *mode {
            Mode::Direct => return Tensor::from_vec(values, shape, device),
            Mode::Record(memo) => (memo, false),
            Mode::Replay(memo) => (memo, true),
        };
        let key = Key {
            dtype: T::DTYPE,
            dims: shape.dims().to_vec(),
            bytes: T::key_bytes(&values),
        };
        if let Some(t) = memo.tensors.get(&key) {
            return Ok(t.clone());
        }
        if replaying {
            bail!(
                "an upload of {:?} {:?} was not made by the recorded forward: the capture \
                 would copy from host memory",
                T::DTYPE,
                shape.dims()
            )
        }
        let t = copy(values, shape, device)?;
        memo.tensors.insert(key, t.clone());
        Ok(t)
    })
}

/// Puts the thread in `mode` for `f`, and returns what `f` left in it.
fn scoped<R>(mode: Mode, f: impl FnOnce() -> R) -> (R, Mode) {
    let previous = MODE.with(|m| std::mem::replace(&mut *m.borrow_mut(), mode));
    // Restore even if `f` panics, so a later forward on this thread uploads normally.
    struct Restore(Option<Mode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                MODE.with(|m| *m.borrow_mut() = previous);
            }
        }
    }
    let mut restore = Restore(Some(previous));
    let out = f();
    let previous = restore.0.take().expect("set above");
    let left = MODE.with(|m| std::mem::replace(&mut *m.borrow_mut(), previous));
    (out, left)
}

fn memo_of(mode: Mode) -> UploadMemo {
    match mode {
        Mode::Record(memo) | Mode::Replay(memo) => memo,
        Mode::Direct => UploadMemo::default(),
    }
}

/// Runs `f` keeping every [`upload`] it makes (on this thread) in a new memo.
pub fn recording<R>(f: impl FnOnce() -> R) -> (R, UploadMemo) {
    let (out, mode) = scoped(Mode::Record(UploadMemo::default()), f);
    (out, memo_of(mode))
}

/// Runs `f` with every [`upload`] it makes (on this thread) answered from `memo`, without a
/// copy; an upload `memo` does not hold is an error. Returns the memo back.
pub fn replaying<R>(memo: UploadMemo, f: impl FnOnce() -> R) -> (R, UploadMemo) {
    let (out, mode) = scoped(Mode::Replay(memo), f);
    (out, memo_of(mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_returns_the_recorded_tensor_and_refuses_new_content() -> Result<()> {
        let dev = Device::Cpu;
        let (first, memo) = recording(|| upload(vec![1u32, 2, 3], 3, &dev));
        let first = first?;
        assert_eq!(memo.len(), 1);
        let (again, memo) = replaying(memo, || upload(vec![1u32, 2, 3], 3, &dev));
        assert_eq!(again?.id(), first.id());
        let (other, memo) = replaying(memo, || upload(vec![1u32, 2, 4], 3, &dev));
        assert!(other.is_err());
        let (reshaped, _) = replaying(memo, || upload(vec![1u32, 2, 3], (3, 1), &dev));
        assert!(reshaped.is_err());
        // Outside the scopes uploads copy again.
        let plain = upload(vec![1u32, 2, 3], 3, &dev)?;
        assert_ne!(plain.id(), first.id());
        Ok(())
    }
}
