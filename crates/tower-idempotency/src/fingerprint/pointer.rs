//! The JSON Pointers of body fields left out of a fingerprint, matched against the path of
//! each member while the body is read, as `serde_json::Value::pointer_mut` resolves them.

/// One reference token of a pointer (`~1` and `~0` decoded).
struct Token {
    name: Vec<u8>,
    /// The array index it names, by `Value::pointer_mut`'s rule (no `+`, no leading zero).
    index: Option<usize>,
}

/// The pointers of the fields left out; only object members are ever left out.
pub(super) struct Exclusions {
    pointers: Vec<Vec<Token>>,
}

impl Exclusions {
    /// The pointers that can name a member: `/`-prefixed ones (`/a/b`); others name nothing.
    pub(super) fn new(pointers: &[String]) -> Self {
        let pointers = pointers
            .iter()
            .filter_map(|pointer| pointer.strip_prefix('/'))
            .map(|tail| tail.split('/').map(Token::new).collect())
            .collect();
        Self { pointers }
    }

    /// How many pointers there are: each is live at the document's root.
    pub(super) fn len(&self) -> u32 {
        self.pointers.len() as u32
    }

    /// Where pointer `p`, matching the path to depth `depth`, goes at the member `name`.
    pub(super) fn at_member(&self, p: u32, depth: usize, name: &[u8]) -> Step {
        let tokens = &self.pointers[p as usize];
        match tokens.get(depth) {
            Some(token) if token.name == name && tokens.len() == depth + 1 => Step::Ends,
            Some(token) if token.name == name => Step::GoesOn,
            _ => Step::Elsewhere,
        }
    }

    /// Whether pointer `p`, matching the path to depth `depth`, goes on into array element
    /// `index` (a pointer ending at an element leaves nothing out).
    pub(super) fn goes_into_element(&self, p: u32, depth: usize, index: usize) -> bool {
        let tokens = &self.pointers[p as usize];
        tokens.len() > depth + 1 && tokens[depth].index == Some(index)
    }
}

/// Where a pointer goes at an object member.
pub(super) enum Step {
    /// It names this member: the member is left out.
    Ends,
    /// It names something inside this member's value.
    GoesOn,
    /// It names another member.
    Elsewhere,
}

impl Token {
    fn new(raw: &str) -> Self {
        let name = raw.replace("~1", "/").replace("~0", "~");
        let index = if name.starts_with('+') || (name.starts_with('0') && name.len() != 1) {
            None
        } else {
            name.parse().ok()
        };
        Self {
            name: name.into_bytes(),
            index,
        }
    }
}
