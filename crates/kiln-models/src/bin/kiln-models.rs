//! `kiln-models fetch minilm`: downloads (once) and prints the folder of a pretrained model.

use std::process::ExitCode;

const USAGE: &str = "usage: kiln-models fetch minilm\n\
                     \n\
                     Puts all-MiniLM-L6-v2 (model.safetensors, tokenizer.json, config.json) in the \
                     kiln cache ($KILN_CACHE_DIR/models, default ~/.cache/kiln/models) and prints \
                     its folder.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["fetch", "minilm"] => match kiln_models::fetch::fetch_minilm() {
            Ok(dir) => {
                println!("{}", dir.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        ["-h"] | ["--help"] | ["help"] => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
