//! The row form: for each question, `state ++ branch_j` run on its own from an empty cache, the
//! head read at its positions past the state (docs/CONTRACT.md §3). Slow, and not how Kev scores:
//! it is the reference the prefix form ([`DecisionModel::run`]) is checked against.

use kev_core::{Record, Result, Row};

use crate::device::{backend_err, recovered};
use crate::plan::split_logits;
use crate::DecisionModel;

/// Logits per question of `record` in row form.
pub fn row_logits(model: &DecisionModel, record: &Record) -> Result<Vec<Vec<f32>>> {
    let (state, rows) = model.encode(record)?.rows();
    let exec = &model.exec;
    let logits = rows
        .iter()
        .map(|row| {
            let ids: Vec<u32> = state.iter().chain(&row.ids).copied().collect();
            let mut cache = exec.model().new_cache(1).map_err(backend_err("row form"))?;
            let hidden = exec.hidden(&[ids], &mut cache)?;
            let shifted = [Row {
                ids: row.ids.clone(),
                decide: row.decide + state.len(),
                opts: row.opts.iter().map(|o| o + state.len()).collect(),
            }];
            let flat = exec
                .head_logits(&hidden, &shifted)?
                .to_vec1::<f32>()
                .map_err(backend_err("pointer head"))?;
            Ok(split_logits(&flat, &shifted).remove(0))
        })
        .collect();
    recovered(model.device(), logits)
}
