//! `kylin logits`: the best logits at every position, for comparing with other engines.

use anyhow::Result;
use kylin_loader::KylinError;

use crate::args::LogitsArgs;
use crate::open::open;
use crate::run::parse_ids;

pub fn run(args: LogitsArgs) -> Result<()> {
    let mut opened = open(&args.model, args.prompt.is_some())?;
    let backend = opened.backend.as_mut();
    let ids = match (&args.ids, &args.prompt) {
        (Some(ids), _) => parse_ids(ids, backend.vocab_size())?,
        (None, Some(text)) => backend.tokenize(text, true)?,
        (None, None) => return Err(KylinError::input_invalid("give the input with --ids or --prompt").into()),
    };
    if ids.is_empty() {
        return Err(KylinError::input_invalid("the input has no tokens").into());
    }
    let vocab = backend.vocab_size();
    let logits = backend.prefill_all_logits(&ids)?;
    let top = args.top.clamp(1, vocab);
    let positions: Vec<Vec<(u32, f32)>> = logits.chunks_exact(vocab).map(|row| top_k(row, top)).collect();
    if args.json {
        let out = serde_json::json!({
            "input_ids": ids,
            "positions": positions.iter().map(|p| serde_json::json!({ "top": p })).collect::<Vec<_>>(),
        });
        println!("{out}");
    } else {
        for (pos, (id, row)) in ids.iter().zip(&positions).enumerate() {
            let text = backend.detokenize(&[*id], false).unwrap_or_default();
            println!("position {pos} (input id {id} {text:?}):");
            for (rank, (cand, logit)) in row.iter().enumerate() {
                let piece = backend.detokenize(&[*cand], false).unwrap_or_default();
                println!("  {:>3}. {cand:>7} {logit:>12.6}  {piece:?}", rank + 1);
            }
        }
    }
    Ok(())
}

/// The `k` largest `(id, logit)` pairs, best first; ties keep the lower id first.
fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, by_logit);
        idx.truncate(k);
    }
    idx.sort_by(by_logit);
    idx.into_iter().map(|i| (i, row[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn top_k_is_sorted_best_first_with_stable_ties() {
        let row = [0.5, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(top_k(&row, 3), vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        assert_eq!(top_k(&row, 10).len(), 5);
    }
}
