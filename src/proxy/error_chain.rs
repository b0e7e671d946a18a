//! An error and its causes as one line of text, for logs and refusal bodies.

/// `e`'s text followed by each cause's that it does not already contain.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        // Some errors (hyper's among them) already say their cause in their own text.
        let cause = c.to_string();
        if !s.contains(&cause) {
            s.push_str(": ");
            s.push_str(&cause);
        }
        cur = c.source();
    }
    s
}
