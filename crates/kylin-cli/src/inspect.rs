//! `kylin inspect`: validate a model and describe it.

use anyhow::Result;
use kylin_loader::LoadOptions;

use crate::args::InspectArgs;

pub fn run(args: InspectArgs) -> Result<()> {
    let opts = LoadOptions {
        tensor_map: args.tensor_map,
        allow_vocab_mismatch: args.allow_vocab_mismatch,
        require_tokenizer: false,
        prefetch: false,
    };
    let report = kylin_loader::inspect(&args.model, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.to_human());
    }
    Ok(())
}
