//! One `sincosf` where a CUDA kernel takes both the sine and the cosine of one value (sin+cos,
//! rotary embeddings): CUDA's `sincosf` reduces the argument once for both, where `sinf` and
//! `cosf` each reduce it (their fast paths share arithmetic the compiler may merge, their slow
//! paths — Payne-Hanek for large arguments — it does not). The values are the same functions'
//! (the GPU op suite compares compiled with eager bit for bit, and gpu_compile's
//! `sine_and_cosine_of_one_value_match_eager` holds this pass to it).
//!
//! A pass over a kernel's text: `ir/lower.rs` writes each value as `const T tN = expr;` on a line
//! of its own, a sine as `kiln_sinf(x)` (f32) or `kiln_sin(x)` (f64). A sine and a cosine of the
//! same operand with no brace between them (one straight-line block) become one call, declared
//! where the first was.

/// `text` with each such pair of lines written as one `kiln_sincos[f]` call.
pub(super) fn pair(text: &str) -> String {
    if !text.contains("kiln_sin") || !text.contains("kiln_cos") {
        return text.to_string();
    }
    let mut lines: Vec<Option<String>> = text.lines().map(|l| Some(l.to_string())).collect();
    for i in 0..lines.len() {
        let Some(first) = lines[i].as_deref().and_then(Trig::parse) else {
            continue;
        };
        for j in i + 1..lines.len() {
            let Some(line) = lines[j].as_deref() else {
                continue;
            };
            if line.contains('{') || line.contains('}') {
                break;
            }
            let Some(second) = Trig::parse(line) else {
                continue;
            };
            if second.sine == first.sine
                || second.ty != first.ty
                || second.arg != first.arg
                || second.suffix != first.suffix
            {
                continue;
            }
            let (s, c) = match first.sine {
                true => (&first.out, &second.out),
                false => (&second.out, &first.out),
            };
            lines[i] = Some(format!(
                "{}{} {s}, {c}; kiln_sincos{}({}, &{s}, &{c});",
                first.indent, first.ty, first.suffix, first.arg
            ));
            lines[j] = None;
            break;
        }
    }
    let mut out: String = lines.into_iter().flatten().collect::<Vec<_>>().join("\n");
    if text.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// `const T out = kiln_sin[f](arg);` or the cosine, parsed.
struct Trig {
    indent: String,
    ty: String,
    out: String,
    sine: bool,
    suffix: &'static str,
    arg: String,
}

impl Trig {
    fn parse(line: &str) -> Option<Trig> {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let rest = body.strip_prefix("const ")?;
        let (ty, rest) = rest.split_once(' ')?;
        let (out, call) = rest.split_once(" = ")?;
        let (func, arg) = call.strip_suffix(");")?.split_once('(')?;
        let (sine, suffix) = match func {
            "kiln_sinf" => (true, "f"),
            "kiln_cosf" => (false, "f"),
            "kiln_sin" => (true, ""),
            "kiln_cos" => (false, ""),
            _ => return None,
        };
        // an operand that is a value's name, not an expression
        let simple =
            |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        (simple(out) && simple(arg)).then(|| Trig {
            indent: indent.to_string(),
            ty: ty.to_string(),
            out: out.to_string(),
            sine,
            suffix,
            arg: arg.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::pair;

    #[test]
    fn a_sine_and_a_cosine_of_one_value_become_one_call() {
        let text = "  {\n    const float t1 = kiln_sinf(t0);\n    const float t2 = kiln_cosf(t0);\n    const float t3 = t1 + t2;\n  }\n";
        let got = pair(text);
        assert_eq!(
            got,
            "  {\n    float t1, t2; kiln_sincosf(t0, &t1, &t2);\n    const float t3 = t1 + t2;\n  }\n"
        );
        // the cosine first, f64
        let text = "const double t4 = kiln_cos(t2);\nconst double t5 = t4 * t4;\nconst double t6 = kiln_sin(t2);\n";
        assert_eq!(
            pair(text),
            "double t6, t4; kiln_sincos(t2, &t6, &t4);\nconst double t5 = t4 * t4;\n"
        );
    }

    #[test]
    fn other_operands_other_types_and_other_blocks_stay_apart() {
        for text in [
            // different operands
            "const float t1 = kiln_sinf(t0);\nconst float t2 = kiln_cosf(t9);\n",
            // f32 sine, f64 cosine
            "const float t1 = kiln_sinf(t0);\nconst double t2 = kiln_cos(t0);\n",
            // a brace between them: another block
            "const float t1 = kiln_sinf(t0);\n}\nconst float t2 = kiln_cosf(t0);\n",
            // two sines
            "const float t1 = kiln_sinf(t0);\nconst float t2 = kiln_sinf(t0);\n",
        ] {
            assert_eq!(pair(text), text);
        }
    }
}
